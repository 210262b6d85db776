"""Causal attention of a flattened batch of queries over a paged KV cache.

Scope
-----
One attention layer, prefill chunks and decodes mixed in one launch.  The
queries of B requests are concatenated along the token axis; request ``b`` owns
rows ``query_start_loc[b]:query_start_loc[b+1]`` of ``q`` and its context
(prefix + its own queries, whose K/V are already written) has ``seq_lens[b]``
tokens scattered over the physical blocks listed in ``block_tables[b]``.

Invariants
----------
* ``k_cache``/``v_cache``: [num_blocks, block_size, num_kv_heads, head_dim];
  slot = block_id * block_size + offset.  Any strides are accepted.
* Query ``i`` of request ``b`` sits at context position
  ``seq_lens[b] - q_len_b + i`` and sees positions ``0 .. its own position``.
* GQA: q head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``.
* Block-table entries past ``ceil(seq_len / block_size)`` are never read.
* Triton path: head_dim and block_size powers of two >= 16.  The reference
  accepts any block size / head dim.

The Triton kernel ``_paged_attn_kernel`` is shared with ``tree_attention``: the
only difference is the mask predicate (``TREE_MASK`` constexpr), so it lives
here once.
"""

import math
from typing import Optional

import torch

from ._triton import HAS_TRITON, tl, triton  # noqa: F401 (HAS_TRITON re-exported)
from ._triton import next_pow2 as _next_pow2
LOG2E = 1.4426950408889634


@triton.jit
def _paged_attn_kernel(
    out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # int32 [B, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [B]
    query_start_loc_ptr,  # int32 [B + 1]
    tree_mask_ptr,  # int32 [T, W] (only read when TREE_MASK)
    sm_scale_log2,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    stride_mt,
    GROUP: tl.constexpr,  # q heads per kv head
    GROUP_P2: tl.constexpr,  # next power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # query tokens per program
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    BLOCK_N: tl.constexpr,  # keys per tile, a multiple of BLOCK_SIZE
    TREE_MASK: tl.constexpr,
):
    # grid = (B, cdiv(max_query_len, BLOCK_Q), Hkv).  A program owns BLOCK_Q
    # query tokens x GROUP q heads of one kv head, so each K/V tile it loads is
    # reused by the whole GQA group: rows r = token * GROUP_P2 + head_in_group.
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P2
    seq = tl.program_id(0)
    q_blk = tl.program_id(1)
    kv_head = tl.program_id(2)

    # Step 1: per-request scalars (3 int32 loads).
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_blk * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_blk * BLOCK_Q + rows // GROUP_P2  # [BLOCK_M] local query index
    g = rows % GROUP_P2
    q_head = kv_head * GROUP + g
    row_ok = (tok < q_len) & (g < GROUP)
    q_pos = prefix_len + tok  # [BLOCK_M] context position of each row
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    # Step 2: load the Q tile once: BLOCK_M * HEAD_DIM elements.
    q_off = (q_start + tok)[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Keys needed: positions < last query position of this program + 1.
    kv_end = tl.minimum(prefix_len + (q_blk + 1) * BLOCK_Q, seq_len)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    for j in range(0, num_tiles):
        # Step 3: BLOCK_N / BLOCK_SIZE block-table entries (int32, cached), then
        # K for BLOCK_N keys = BLOCK_N * HEAD_DIM elements from HBM (contiguous
        # HEAD_DIM rows; pages are contiguous per kv head when strides are dense).
        k_pos = j * BLOCK_N + offs_n  # [BLOCK_N]
        k_ok = k_pos < kv_end
        block_id = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        slot_off = block_id.to(tl.int64) * stride_kb + (k_pos % BLOCK_SIZE) * stride_ks  # [BLOCK_N]
        k_off = slot_off[None, :] + kv_head * stride_kh + offs_d[:, None] * stride_kd
        k = tl.load(k_cache_ptr + k_off, mask=k_ok[None, :], other=0.0)  # [HEAD_DIM, BLOCK_N]

        # Step 4: scores in registers (no memory traffic).
        s = tl.dot(q, k) * sm_scale_log2  # [BLOCK_M, BLOCK_N], log2 domain
        if TREE_MASK:
            # Prefix is always visible; node j visible iff bit j of the row's
            # mask is set.  Reads BLOCK_M x BLOCK_N int32 (L1/L2 resident).
            node = k_pos - prefix_len
            is_node = (node >= 0) & k_ok
            node_c = tl.where(is_node, node, 0)
            w_off = (q_start + tok)[:, None] * stride_mt + (node_c // 32)[None, :]
            words = tl.load(tree_mask_ptr + w_off, mask=row_ok[:, None] & is_node[None, :], other=0)
            bit = (words >> (node_c % 32)[None, :]) & 1
            visible = ((k_pos < prefix_len)[None, :] | (bit != 0)) & k_ok[None, :]
        else:
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        s = tl.where(visible, s, float("-inf"))

        # Step 5: online softmax update (registers only).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        # Step 6: V tile (BLOCK_N * HEAD_DIM elements) and P @ V.
        v_slot = block_id.to(tl.int64) * stride_vb + (k_pos % BLOCK_SIZE) * stride_vs
        v_off = v_slot[:, None] + kv_head * stride_vh + offs_d[None, :] * stride_vd
        v = tl.load(v_cache_ptr + v_off, mask=k_ok[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # Step 7: normalise and write BLOCK_M * HEAD_DIM outputs.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_off = (q_start + tok)[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def launch_paged_attn(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                      max_query_len, tree_mask=None) -> torch.Tensor:
    """Shared launcher for paged_attention_triton and tree_attention_triton."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    T, Hq, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    assert Dk == D and Hq % Hkv == 0, "head_dim mismatch or Hq not a multiple of Hkv"
    assert D >= 16 and D & (D - 1) == 0, "triton path needs a power-of-two head_dim >= 16"
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size must be a power of two >= 16"
    out = torch.empty_like(q)
    B = seq_lens.shape[0]
    if T == 0 or B == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    group = Hq // Hkv
    group_p2 = _next_pow2(group)
    # BLOCK_M = BLOCK_Q * GROUP_P2 rows: >= 16 for tl.dot, ~64 at most.
    block_q = max(16 // group_p2, 1)
    while block_q * group_p2 < 64 and block_q < _next_pow2(max_query_len):
        block_q *= 2
    if tree_mask is None:
        mask_arg, stride_mt = q, 0  # dummy pointer, never read
    else:
        mask_arg, stride_mt = tree_mask, tree_mask.stride(0)
        assert tree_mask.dtype == torch.int32 and tree_mask.stride(1) == 1
    grid = (B, triton.cdiv(max_query_len, block_q), Hkv)
    _paged_attn_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, mask_arg,
        float(scale) * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0), stride_mt,
        GROUP=group, GROUP_P2=group_p2, BLOCK_Q=block_q, HEAD_DIM=D, BLOCK_SIZE=block_size,
        BLOCK_N=max(block_size, 64 if D <= 64 else 32),
        TREE_MASK=tree_mask is not None,
        num_warps=4 if D <= 64 else 8, num_stages=2,
    )
    return out


def paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                           max_query_len: Optional[int] = None) -> torch.Tensor:
    # q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    # block_tables: int32 [B, max_blocks]; seq_lens: int32 [B]; query_start_loc: int32 [B+1]
    return launch_paged_attn(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len)


# ----------------------------------------------------------------------------
# PyTorch reference
# ----------------------------------------------------------------------------

def gather_kv(k_cache, v_cache, block_table_row, seq_len: int):
    """Contiguous K/V of one request: two [seq_len, Hkv, D] tensors."""
    block_size = k_cache.shape[1]
    pos = torch.arange(seq_len, device=k_cache.device)
    blocks = block_table_row[: (seq_len + block_size - 1) // block_size].long()
    bid = blocks[pos // block_size]
    off = pos % block_size
    return k_cache[bid, off], v_cache[bid, off]


def masked_attention_dense(q, k, v, mask, scale) -> torch.Tensor:
    """q: [n, Hq, D]; k, v: [S, Hkv, D]; mask: bool [n, S] -> [n, Hq, D] (fp32 math)."""
    n, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    qf = q.float().transpose(0, 1)  # [Hq, n, D]
    kf = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
    vf = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, n, S]
    s = s.masked_fill(~mask[None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0
    return torch.matmul(p, vf).transpose(0, 1).to(q.dtype)  # [n, Hq, D]


def per_request_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                          mask_of) -> torch.Tensor:
    """The references' shared loop: request b's queries over its gathered context.

    mask_of(s0, s1, seq_len) -> bool [s1 - s0, seq_len]: which context positions each of the
    request's queries (rows s0..s1 of q) may attend to.
    """
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    sl = seq_lens.tolist()
    for b in range(len(sl)):
        s0, s1, seq_len = qsl[b], qsl[b + 1], sl[b]
        if s1 == s0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], seq_len)
        out[s0:s1] = masked_attention_dense(q[s0:s1], k, v, mask_of(s0, s1, seq_len), scale)
    return out


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                        max_query_len: Optional[int] = None) -> torch.Tensor:
    # Same signature as paged_attention_triton; loops over requests, vectorised over heads.
    def causal(s0, s1, seq_len):
        q_pos = torch.arange(seq_len - (s1 - s0), seq_len, device=q.device)
        return torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, S]

    return per_request_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                 scale, causal)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
