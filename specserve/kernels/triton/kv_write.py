"""Writes into the paged KV cache: scatter new tokens, compact accepted paths.

Scope and invariants
--------------------
* Cache of one layer: [num_blocks, block_size, H, D]; slot = block * block_size + offset.
  ``compact_kv`` also accepts a stacked cache [num_layers, num_blocks, block_size, H, D]
  and moves the rows in every layer.  Any strides are accepted (e.g. a layer slice).
* ``write_kv``: row t of k/v goes to ``slot_mapping[t]``; a negative slot means
  "skip" (padding tokens).  Values are cast to the cache dtype.
* ``compact_kv``: after a draft tree is verified, the accepted path's K/V rows
  move from ``src_slots`` to consecutive ``dst_slots``.  Requirement: ``dst`` is
  increasing and ``dst[i] <= src[i]`` (and ``src`` increasing, as a tree path
  is), so copying in increasing ``i`` never overwrites a source that is still
  to be read.  The Triton kernel therefore walks ``i`` sequentially inside a
  program and parallelises over (layer, head), which never alias.  The result
  equals ``cache[dst] = cache[src].clone()``.  Every entry is a valid slot (>= 0).
"""
import torch

from ._triton import HAS_TRITON, tl, triton  # noqa: F401 (HAS_TRITON re-exported)
from ._triton import next_pow2 as _next_pow2


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr,  # [T, H, D]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, BLOCK_SIZE, H, D]
    slot_ptr,  # int64 [T]
    H, D,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid = (T,): one program per token.
    t = tl.program_id(0)
    # Step 1: one int64 slot load.
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    m = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    # Step 2: read H*D elements of k and of v, write them to the cache (2 x 2 x H*D).
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=m)
    kc = blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
    tl.store(k_cache_ptr + kc, k.to(k_cache_ptr.dtype.element_ty), mask=m)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=m)
    vc = blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    tl.store(v_cache_ptr + vc, v.to(v_cache_ptr.dtype.element_ty), mask=m)


@triton.jit
def _compact_kv_kernel(
    k_cache_ptr, v_cache_ptr,  # [L, num_blocks, BLOCK_SIZE, H, D]
    src_ptr, dst_ptr,  # int64 [N]
    N, D,
    stride_kl, stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vl, stride_vb, stride_vs, stride_vh, stride_vd,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid = (L, H): programs touch disjoint (layer, head) rows, so no races;
    # within a program rows are moved in increasing i (see module docstring).
    layer = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dm = offs_d < D
    k_base = k_cache_ptr + layer * stride_kl + head * stride_kh + offs_d * stride_kd
    v_base = v_cache_ptr + layer * stride_vl + head * stride_vh + offs_d * stride_vd
    for i in range(0, N):
        # Step 1: two int64 loads (src, dst slot).
        src = tl.load(src_ptr + i)
        dst = tl.load(dst_ptr + i)
        # Step 2: read D elements of K and of V at src, write them at dst.
        s_blk = src // BLOCK_SIZE
        s_off = src % BLOCK_SIZE
        d_blk = dst // BLOCK_SIZE
        d_off = dst % BLOCK_SIZE
        k = tl.load(k_base + s_blk * stride_kb + s_off * stride_ks, mask=dm)
        v = tl.load(v_base + s_blk * stride_vb + s_off * stride_vs, mask=dm)
        tl.store(k_base + d_blk * stride_kb + d_off * stride_ks, k, mask=dm)
        tl.store(v_base + d_blk * stride_vb + d_off * stride_vs, v, mask=dm)
        tl.debug_barrier()


def write_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    # k, v: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, H, D]; slot_mapping: int64 [T]
    T, H, D = k.shape
    if T == 0:
        return
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (H, D)
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, H, D,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=_next_pow2(H), BLOCK_D=_next_pow2(D), num_warps=4,
    )


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    # Same signature as write_kv_triton; in place.
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    keep = slots >= 0
    slots = slots[keep]
    blk, off = slots // block_size, slots % block_size
    k_cache[blk, off] = k[keep].to(k_cache.dtype)
    v_cache[blk, off] = v[keep].to(v_cache.dtype)


def _as_layered(cache: torch.Tensor) -> torch.Tensor:
    if cache.dim() == 4:
        return cache.unsqueeze(0)
    assert cache.dim() == 5, "cache must be [num_blocks, bs, H, D] or [L, num_blocks, bs, H, D]"
    return cache


def compact_kv_triton(k_cache, v_cache, src_slots, dst_slots) -> None:
    # k_cache, v_cache: [(L,) num_blocks, block_size, H, D]; src_slots, dst_slots: int64 [N]
    kc, vc = _as_layered(k_cache), _as_layered(v_cache)
    N = src_slots.numel()
    if N == 0:
        return
    L, _, block_size, H, D = kc.shape
    _compact_kv_kernel[(L, H)](
        kc, vc, src_slots.contiguous(), dst_slots.contiguous(), N, D,
        *kc.stride(), *vc.stride(),
        BLOCK_SIZE=block_size, BLOCK_D=_next_pow2(D), num_warps=1,
    )


def compact_kv_ref(k_cache, v_cache, src_slots, dst_slots) -> None:
    # Same signature as compact_kv_triton; in place: cache[dst] = cache[src].clone().
    kc, vc = _as_layered(k_cache), _as_layered(v_cache)
    src, dst = src_slots.to(kc.device), dst_slots.to(kc.device)
    for cache in (kc, vc):
        slots = cache.view(cache.shape[0], -1, *cache.shape[3:])  # [L, num_blocks * block_size, H, D]
        slots.index_copy_(1, dst, slots.index_select(1, src))  # gathered first: overlaps are safe

