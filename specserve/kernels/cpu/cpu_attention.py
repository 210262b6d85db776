"""Paged attention for decode and verify rows on x86 CPUs: our AVX2/FMA kernel
(`paged_attention.c`), float32, with its score and value passes in AVX-512 where the CPU has it
and a measurement at start finds it faster (`pick_wide`; the same bits either way).

It reads each request's keys and values in place through the block table, where the SDPA path
first gathers every request's context into a padded batch (a copy of the whole context per
layer and step). Each row's result is independent of the batch around it (see the C source).
Built and loaded by specserve.kernels.cpu.cbuild; `available()` says whether it can run here.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import torch

from specserve.kernels.cpu.cbuild import Kernel

MAX_GROUP = 16  # query heads per KV head (MAX_GROUP in paged_attention.c)
MAX_ROWS = 16  # query tokens per request (MAX_ROWS)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_attention.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr,
                                    ptr, i64, ctypes.c_float, ptr, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.paged_attention.restype = ctypes.c_int
    lib.paged_attention_wide.argtypes = [ctypes.c_int]
    lib.paged_attention_wide.restype = ctypes.c_int
    lib.paged_attention_wide(0)  # AVX2 until pick_wide measures


_kernel = Kernel(Path(__file__).with_name("paged_attention.c"), _declare)


def available() -> bool:
    return _kernel.available()


def why_unavailable() -> str | None:
    return _kernel.why_unavailable()


def wide(on: bool | None = None) -> bool:
    """Whether the score and value passes use AVX-512 (the same bits as AVX2); on: True / False
    sets it (True only takes where the CPU has AVX-512F), None asks."""
    global _picked
    if on is not None:
        _picked = True
    return bool(_kernel.lib.paged_attention_wide(-1 if on is None else int(on)))


_picked = False  # whether wide() was set (pick_wide, or a caller)


def pick_wide(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Sets and returns whether the kernel runs its AVX-512 passes: where the CPU has AVX-512F
    (and is not kept to AVX2 by ATEN_CPU_CAPABILITY, as the emulated AVX2 machine of
    docs/benchmarks.md is), when they are faster for a model of this shape at one request
    verifying 8 rows over 1,024 keys, side by side (best of 3 rounds). The kernel's first call
    in a process asks (at engine start, the cost model's measurement). CPUs that split 512-bit
    operations may gain nothing."""
    on = (available() and head_dim % 16 == 0
          and os.environ.get("ATEN_CPU_CAPABILITY", "").lower() not in ("avx2", "default") and wide(True))
    return wide(on and _wide_is_faster(num_heads, num_kv_heads, head_dim))


def _wide_is_faster(num_heads: int, num_kv_heads: int, head_dim: int, rows: int = 8, keys: int = 1024) -> bool:
    gen = torch.Generator().manual_seed(0)
    block_size, blocks = 16, (keys + rows) // 16 + 1
    k_cache = torch.randn(blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(blocks, block_size, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(rows, num_heads, head_dim, generator=gen)
    args = (q, k_cache, v_cache, torch.arange(blocks).unsqueeze(0), torch.tensor([0, rows]),
            torch.arange(keys + 1, keys + rows + 1), torch.zeros(rows + 1, dtype=torch.int64),
            torch.zeros(0, dtype=torch.int64), keys + rows, head_dim ** -0.5)
    best = {True: float("inf"), False: float("inf")}
    for _ in range(3):
        for on in best:
            wide(on)
            paged_attention(*args)
            start = time.perf_counter()
            for _ in range(10):
                paged_attention(*args)
            best[on] = min(best[on], time.perf_counter() - start)
    return best[True] < best[False]


def kernel_address(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """The address of the C function `paged_attention` calls (for a caller in C: decoder.c),
    its AVX-512 choice made first for a model of this shape, as that first call makes it."""
    assert _kernel.lib is not None, _kernel.why_unavailable()
    if not _picked:
        pick_wide(num_heads, num_kv_heads, head_dim)
    return ctypes.cast(_kernel.lib.paged_attention, ctypes.c_void_p).value


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel covers a model of this shape and dtype on this machine."""
    return (dtype == torch.float32 and head_dim % 8 == 0 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP and available())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start: torch.Tensor, dense: torch.Tensor,
                    extra_ptr: torch.Tensor, extra_pos: torch.Tensor, max_keys: int,
                    scale: float, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                    slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] float32 (rows may be strided: a view of the fused q/k/v product); caches
    [num_blocks, block_size, Hkv, D] (contiguous); block_tables [B, max_blocks], query_start
    [B + 1] (at most MAX_ROWS tokens per request), dense [T], extra_ptr [T + 1], extra_pos:
    int64 -> out [T, Hq, D]. Token t of request b sees positions 0 .. dense[t] - 1 of b's
    context, then extra_pos[extra_ptr[t]:extra_ptr[t + 1]]; max_keys bounds dense + extras over
    the tokens. With k, v [T, Hkv, D] (views of one product, the same row stride) and
    slot_mapping [T] int64, the step's new keys and values are written to the caches first, in
    the same call."""
    lib = _kernel.lib
    assert lib is not None, _kernel.why_unavailable()
    num_tokens, num_heads, head_dim = q.shape
    if not _picked:
        pick_wide(num_heads, k_cache.shape[2], head_dim)
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    _, block_size, num_kv, _ = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == q.dtype == torch.float32):
        raise ValueError("paged_attention: float32 query and contiguous float32 caches expected")
    new = (0, 0, 0, 0)
    if k is not None:
        if not (k.stride() == v.stride() and k.stride(2) == 1 and k.stride(1) == head_dim
                and k.shape == v.shape == (num_tokens, num_kv, head_dim) and k.dtype == v.dtype == torch.float32):
            k, v = k.contiguous(), v.contiguous()  # (the same strides after)
        new = (k.data_ptr(), v.data_ptr(), k.stride(0), slot_mapping.data_ptr())
    for t in (block_tables, query_start, dense, extra_ptr, extra_pos) + (() if k is None else (slot_mapping,)):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError("paged_attention: index tensors must be contiguous int64")
    out = q.new_empty(q.shape)
    if num_tokens:
        rc = lib.paged_attention(q.data_ptr(), q.stride(0), len(query_start) - 1, num_heads, num_kv, head_dim,
                                 k_cache.data_ptr(), v_cache.data_ptr(), block_size,
                                 block_tables.data_ptr(), block_tables.shape[1], query_start.data_ptr(),
                                 dense.data_ptr(), extra_ptr.data_ptr(), extra_pos.data_ptr(),
                                 max_keys, scale, *new, out.data_ptr(), torch.get_num_threads())
        if rc == -2:
            raise ValueError(f"paged_attention: at most {MAX_ROWS} query tokens per request")
        if rc != 0:
            raise MemoryError("paged_attention: could not allocate scratch memory")
    return out
