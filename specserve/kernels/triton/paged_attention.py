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
* Triton path: head_dim and block_size powers of two >= 16, block_size <=
  ``PARTITION_SIZE``.  The reference accepts any block size / head dim.

The Triton kernels (split-KV, "flash-decoding")
-----------------------------------------------
A request's context is cut into partitions of ``PARTITION_SIZE`` keys
(positions ``[p * P, (p + 1) * P)``), a constant.  A program owns one kv head
and ``BLOCK_Q`` query tokens x the GQA group's query heads (``BLOCK_M = 64``
rows, also a constant), so every K/V tile it loads serves the whole group.
Within a partition it keeps an online softmax over tiles of ``BLOCK_N`` keys
(max ``m``, sum ``l``, unnormalised output ``acc``); the partitions' states are
then merged in increasing ``p`` (``_merge``).  Every row therefore sees the
same tiles, the same partitions and the same merge order whatever the batch
around it, however many rows its request brings and whichever launch mode
runs: its bits depend only on its own query, its own keys and the constants.
Fully masked tiles and partitions are exact no-ops (``alpha = 1``, ``p = 0``),
so skipping them, or a decode row seeing fewer keys than the same token's
verify row, changes nothing.

Two launch modes give the same bits; the launcher picks one for speed only:

* split (few programs otherwise, short queries): ``_attn_split_kernel``, grid
  (partition, kv head, request); one program reads its partition's K/V once
  for all query tokens of its request (looping over their ``BLOCK_Q`` blocks),
  writes each row's partial (m, l, acc) in float32, or the final output for a
  row whose context fits in partition 0; then ``_attn_reduce_kernel``, grid
  (token, kv head, request), merges each row's partials in order.
* fused: ``_attn_fused_kernel``, grid (query block, kv head, request); one
  program walks the partitions in order and merges them in registers: no
  partial buffers, no second launch (a one-partition context never pays the
  reduction in either mode).

Tree attention (tree_attention.py) is the same kernels with ``TREE_MASK``:
only the visibility predicate differs, so a chain tree gives the paged bits.
"""

import math
from typing import Optional

import torch

from ._triton import HAS_TRITON, tl, triton  # noqa: F401 (HAS_TRITON re-exported)
from ._triton import EXACT_FP
from ._triton import next_pow2 as _next_pow2

LOG2E = 1.4426950408889634
# Keys per partition: fixes every row's reduction order, so never derived from the batch.
PARTITION_SIZE = 256
# Query rows (tokens x heads of one GQA group) per program: a constant for the same reason.
BLOCK_M = 64
# Per head size: keys per tile, warps, pipeline stages, and whether each iteration loads the
# next tile before the math (prefetch). Constants of every launch (a row's bits must not depend
# on the step it is in); benchmarks/attention_tune.py times alternatives on a GPU (head size 128
# and PARTITION_SIZE: its best on an H200 under CUDA-graph timing, docs/benchmarks.md).
CONFIG = {64: dict(block_n=64, num_warps=4, num_stages=2),
          128: dict(block_n=32, num_warps=4, num_stages=2, prefetch=True)}
# Partitions whose partials the reduction loads together (speed only: the merges stay in order).
REDUCE_LOAD_AHEAD = 8
# Launch-mode heuristics (speed only: both modes give the same bits).
SPLIT_MAX_QUERY = 128  # longest query of a step that may run split
SPLIT_MAX_BYTES = 256 << 20  # largest partial buffers (float32 m, l, acc) a step may allocate


@triton.jit
def _q_block(q_ptr, q_start, q_len, qb, kv_head, stride_qt, stride_qh, stride_qd,
             GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr,
             HEAD_DIM: tl.constexpr):
    # Rows r = token * GROUP_P2 + head_in_group of query block qb; loads BLOCK_M * HEAD_DIM of q.
    rows = tl.arange(0, BLOCK_Q * GROUP_P2)
    tok = qb * BLOCK_Q + rows // GROUP_P2  # local query index
    g = rows % GROUP_P2
    q_head = kv_head * GROUP + g
    row_ok = (tok < q_len) & (g < GROUP)
    offs_d = tl.arange(0, HEAD_DIM)
    q_off = (q_start + tok)[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
    return tok, q_head, row_ok, q


@triton.jit
def _kv_tile(start, kv_hi, seq, kv_head, k_cache_ptr, v_cache_ptr, block_tables_ptr,
             stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, stride_bt,
             HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    # Keys start .. start + BLOCK_N - 1 (those < kv_hi): BLOCK_N / BLOCK_SIZE block-table entries
    # (int32, cached), then K^T [HEAD_DIM, BLOCK_N] and V [BLOCK_N, HEAD_DIM] (contiguous HEAD_DIM
    # rows). A tile past kv_hi is all masked: no memory traffic.
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_pos = start + offs_n
    k_ok = k_pos < kv_hi
    block_id = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    k_off = (block_id * stride_kb + (k_pos % BLOCK_SIZE) * stride_ks)[None, :] + kv_head * stride_kh \
        + offs_d[:, None] * stride_kd
    k = tl.load(k_cache_ptr + k_off, mask=k_ok[None, :], other=0.0)
    v_off = (block_id * stride_vb + (k_pos % BLOCK_SIZE) * stride_vs)[:, None] + kv_head * stride_vh \
        + offs_d[None, :] * stride_vd
    v = tl.load(v_cache_ptr + v_off, mask=k_ok[:, None], other=0.0)
    return k_pos, k_ok, k, v


@triton.jit
def _partition_state(q, tok, row_ok, q_start, prefix_len, kv_lo, kv_hi, seq, kv_head, sm_scale_log2,
                     k_cache_ptr, v_cache_ptr, block_tables_ptr, tree_mask_ptr,
                     stride_kb, stride_ks, stride_kh, stride_kd,
                     stride_vb, stride_vs, stride_vh, stride_vd,
                     stride_bt, stride_mt,
                     BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_N: tl.constexpr, TREE_MASK: tl.constexpr, PREFETCH: tl.constexpr):
    # Online softmax of the rows over keys kv_lo .. kv_hi - 1 (kv_lo: a partition's start).
    # Returns the partition's (m, l, acc) in the log2 domain, acc not normalised.
    # PREFETCH: each iteration issues the next tile's loads before computing on the current one
    # (registers double-buffered by hand), so the table -> K/V load chain of one tile overlaps
    # the previous tile's math; the arithmetic, and so the bits, are the same either way.
    q_pos = prefix_len + tok  # context position of each row
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if PREFETCH:
        k_pos, k_ok, k, v = _kv_tile(kv_lo, kv_hi, seq, kv_head, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                                     stride_kb, stride_ks, stride_kh, stride_kd,
                                     stride_vb, stride_vs, stride_vh, stride_vd, stride_bt,
                                     HEAD_DIM, BLOCK_SIZE, BLOCK_N)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        if PREFETCH:
            k_pos_n, k_ok_n, k_n, v_n = _kv_tile(start + BLOCK_N, kv_hi, seq, kv_head, k_cache_ptr, v_cache_ptr,
                                                 block_tables_ptr, stride_kb, stride_ks, stride_kh, stride_kd,
                                                 stride_vb, stride_vs, stride_vh, stride_vd, stride_bt,
                                                 HEAD_DIM, BLOCK_SIZE, BLOCK_N)
        else:
            k_pos, k_ok, k, v = _kv_tile(start, kv_hi, seq, kv_head, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                                         stride_kb, stride_ks, stride_kh, stride_kd,
                                         stride_vb, stride_vs, stride_vh, stride_vd, stride_bt,
                                         HEAD_DIM, BLOCK_SIZE, BLOCK_N)
        s = tl.dot(q, k) * sm_scale_log2  # [BLOCK_M, BLOCK_N], log2 domain
        if TREE_MASK:
            # Prefix always visible; node j visible iff bit j of the row's mask is set
            # (BLOCK_M x BLOCK_N int32 gathers, L1-resident). A tile of the prefix alone skips
            # the mask's arithmetic (the same visibility: every key of it, for every row).
            if start + BLOCK_N <= prefix_len:
                visible = tl.broadcast_to(k_ok[None, :], (BLOCK_M, BLOCK_N))
            else:
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
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = tl.fma(l_i, alpha, tl.sum(p, 1))  # explicit fma: no contraction left to the compiler
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # P @ V into the rescaled acc
        m_i = m_new
        if PREFETCH:
            k_pos, k_ok, k, v = k_pos_n, k_ok_n, k_n, v_n
    return m_i, l_i, acc


@triton.jit
def _merge(M, L, ACC, m_p, l_p, acc_p):
    # Fold one partition's (m, l, acc) into the running state; the one merge both modes use.
    # From the empty state (-inf, 0, 0) it returns (m, l, acc) exactly; an empty partition
    # (-inf, 0, 0) leaves the state exactly as it was.
    M_new = tl.maximum(M, m_p)
    M_safe = tl.where(M_new == float("-inf"), 0.0, M_new)
    a = tl.exp2(M - M_safe)
    b = tl.exp2(m_p - M_safe)
    L = tl.fma(L, a, l_p * b)
    ACC = tl.fma(ACC, a[:, None], acc_p * b[:, None])
    return M_new, L, ACC


@triton.jit
def _normalise(L, ACC):
    return ACC / tl.where(L == 0.0, 1.0, L)[:, None]  # a row that sees nothing -> 0


@triton.jit
def _attn_fused_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr,  # int32 [B, max_blocks]
    seq_lens_ptr,  # int32 [B]
    query_start_loc_ptr,  # int32 [B + 1]
    tree_mask_ptr,  # int32 [T, W] (only read when TREE_MASK)
    sm_scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt, stride_mt,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION: tl.constexpr, TREE_MASK: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # grid = (cdiv(max_query_len, BLOCK_Q), Hkv, B): query blocks of one (kv head, request)
    # are neighbours in launch order, so they share its K/V reads in L2.
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len
    tok, q_head, row_ok, q = _q_block(q_ptr, q_start, q_len, qb, kv_head, stride_qt, stride_qh, stride_qd,
                                      GROUP, GROUP_P2, BLOCK_Q, HEAD_DIM)
    BM: tl.constexpr = BLOCK_Q * GROUP_P2
    kv_hi = prefix_len + tl.minimum((qb + 1) * BLOCK_Q, q_len)  # past the block's last query
    M = tl.full([BM], float("-inf"), dtype=tl.float32)
    L = tl.zeros([BM], dtype=tl.float32)
    ACC = tl.zeros([BM, HEAD_DIM], dtype=tl.float32)
    for lo in range(0, kv_hi, PARTITION):
        m_p, l_p, acc_p = _partition_state(q, tok, row_ok, q_start, prefix_len, lo, tl.minimum(lo + PARTITION, kv_hi),
                                     seq, kv_head, sm_scale_log2, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                                     tree_mask_ptr, stride_kb, stride_ks, stride_kh, stride_kd,
                                     stride_vb, stride_vs, stride_vh, stride_vd, stride_bt, stride_mt,
                                     BM, HEAD_DIM, BLOCK_SIZE, BLOCK_N, TREE_MASK, PREFETCH)
        M, L, ACC = _merge(M, L, ACC, m_p, l_p, acc_p)
    offs_d = tl.arange(0, HEAD_DIM)
    o_off = (q_start + tok)[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptr + o_off, _normalise(L, ACC).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _attn_split_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    tree_mask_ptr,
    part_m_ptr, part_l_ptr,  # float32 [T, Hq, NP]
    part_acc_ptr,  # float32 [T, Hq, NP, HEAD_DIM]
    sm_scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt, stride_mt,
    stride_pt, stride_ph,  # of part_m / part_l (partition stride 1)
    stride_at, stride_ah, stride_ap,  # of part_acc (head_dim stride 1)
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION: tl.constexpr, TREE_MASK: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # grid = (NP, Hkv, B): one program per (partition, kv head, request) reads the partition's
    # K/V once for all the request's query tokens (all the nodes of a tree).
    part = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = part * PARTITION
    if lo >= seq_len:
        return
    prefix_len = seq_len - q_len
    BM: tl.constexpr = BLOCK_Q * GROUP_P2
    offs_d = tl.arange(0, HEAD_DIM)
    # Query blocks before qb_first end before this partition: nothing to do for them.
    qb_first = tl.maximum(lo - prefix_len, 0) // BLOCK_Q
    for qb in range(qb_first, tl.cdiv(q_len, BLOCK_Q)):
        tok, q_head, row_ok, q = _q_block(q_ptr, q_start, q_len, qb, kv_head, stride_qt, stride_qh, stride_qd,
                                          GROUP, GROUP_P2, BLOCK_Q, HEAD_DIM)
        kv_hi = tl.minimum(prefix_len + tl.minimum((qb + 1) * BLOCK_Q, q_len), lo + PARTITION)
        m_p, l_p, acc_p = _partition_state(q, tok, row_ok, q_start, prefix_len, lo, kv_hi,
                                     seq, kv_head, sm_scale_log2, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                                     tree_mask_ptr, stride_kb, stride_ks, stride_kh, stride_kd,
                                     stride_vb, stride_vs, stride_vh, stride_vd, stride_bt, stride_mt,
                                     BM, HEAD_DIM, BLOCK_SIZE, BLOCK_N, TREE_MASK, PREFETCH)
        t = q_start + tok
        last = (prefix_len + tok) // PARTITION  # the row's last partition
        if part == 0:
            # Rows whose context fits in partition 0: final output now, no reduction.
            M, L, ACC = _merge(tl.full([BM], float("-inf"), dtype=tl.float32), tl.zeros([BM], dtype=tl.float32),
                               tl.zeros([BM, HEAD_DIM], dtype=tl.float32), m_p, l_p, acc_p)
            o_off = t[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :] * stride_od
            tl.store(out_ptr + o_off, _normalise(L, ACC).to(out_ptr.dtype.element_ty),
                     mask=(row_ok & (last == 0))[:, None])
        keep = row_ok & (last > 0) & (last >= part)
        p_off = t * stride_pt + q_head * stride_ph + part
        tl.store(part_m_ptr + p_off, m_p, mask=keep)
        tl.store(part_l_ptr + p_off, l_p, mask=keep)
        a_off = t[:, None] * stride_at + q_head[:, None] * stride_ah + part * stride_ap + offs_d[None, :]
        tl.store(part_acc_ptr + a_off, acc_p, mask=keep[:, None])


@triton.jit
def _attn_reduce_kernel(
    out_ptr, seq_lens_ptr, query_start_loc_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    stride_ot, stride_oh, stride_od,
    stride_pt, stride_ph, stride_at, stride_ah, stride_ap,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, PARTITION: tl.constexpr,
    LOAD_AHEAD: tl.constexpr,
):
    # grid = (max_query_len, Hkv, B): one query token x the GQA group's heads; merges the row's
    # partitions 0 .. last in order (reads (last + 1) * GROUP * (HEAD_DIM + 2) float32). The
    # loop is unrolled LOAD_AHEAD partitions at a time, so that their loads are issued together
    # rather than one round trip per partition; a partition past `last` loads as the empty
    # state (-inf, 0, 0), whose merge leaves the running state exactly as it was.
    tok = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tok >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    last = (seq_len - q_len + tok) // PARTITION
    if last == 0:
        return  # written by the split kernel
    g = tl.arange(0, GROUP_P2)
    h_ok = g < GROUP
    q_head = kv_head * GROUP + g
    t = q_start + tok
    offs_d = tl.arange(0, HEAD_DIM)
    M = tl.full([GROUP_P2], float("-inf"), dtype=tl.float32)
    L = tl.zeros([GROUP_P2], dtype=tl.float32)
    ACC = tl.zeros([GROUP_P2, HEAD_DIM], dtype=tl.float32)
    for first in range(0, last + 1, LOAD_AHEAD):
        for j in tl.static_range(LOAD_AHEAD):
            part = first + j
            ok = h_ok & (g * 0 + part <= last)  # (a vector: the interpreter's masks are no scalars)
            p_off = t * stride_pt + q_head * stride_ph + part
            m_p = tl.load(part_m_ptr + p_off, mask=ok, other=float("-inf"))
            l_p = tl.load(part_l_ptr + p_off, mask=ok, other=0.0)
            a_off = t * stride_at + q_head[:, None] * stride_ah + part * stride_ap + offs_d[None, :]
            acc_p = tl.load(part_acc_ptr + a_off, mask=ok[:, None], other=0.0)
            M, L, ACC = _merge(M, L, ACC, m_p, l_p, acc_p)
    o_off = t * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptr + o_off, _normalise(L, ACC).to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


_SM_COUNT = {}


def _sm_count(device) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_split(T, B, Hq, Hkv, D, max_query_len, num_parts, block_q, device) -> bool:
    """Whether a step runs split (partials + reduction) or fused: a speed choice only, the
    bits are the same.  Split when partitions exist, queries are short, the partial buffers
    are small and the fused grid alone would not fill the GPU twice over."""
    if num_parts <= 1 or max_query_len > SPLIT_MAX_QUERY:
        return False
    if T * Hq * num_parts * (D + 2) * 4 > SPLIT_MAX_BYTES:
        return False
    return B * Hkv * triton.cdiv(max_query_len, block_q) < 2 * _sm_count(device)


def launch_paged_attn(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                      max_query_len, tree_mask=None, split: Optional[bool] = None) -> torch.Tensor:
    """Shared launcher for paged_attention_triton and tree_attention_triton.

    ``split``: None lets ``choose_split`` pick the launch mode; True / False force one (the
    result is the same bits either way).
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    T, Hq, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    assert Dk == D and Hq % Hkv == 0, "head_dim mismatch or Hq not a multiple of Hkv"
    assert D >= 16 and D & (D - 1) == 0, "triton path needs a power-of-two head_dim >= 16"
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size must be a power of two >= 16"
    assert block_size <= PARTITION_SIZE, f"block_size must be <= {PARTITION_SIZE}"
    out = torch.empty_like(q)
    B = seq_lens.shape[0]
    if T == 0 or B == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    group = Hq // Hkv
    group_p2 = _next_pow2(group)
    block_q = max(BLOCK_M, group_p2) // group_p2  # BLOCK_Q * GROUP_P2 rows: fixed per (Hq, Hkv)
    tile = CONFIG.get(D) or CONFIG[128 if D > 64 else 64]
    block_n = max(block_size, tile["block_n"])
    # The table holds every block of the longest context: an upper bound without a host sync.
    num_parts = triton.cdiv(block_tables.shape[1] * block_size, PARTITION_SIZE)
    if split is None:
        split = choose_split(T, B, Hq, Hkv, D, max_query_len, num_parts, block_q, q.device)
    if tree_mask is None:
        mask_arg, stride_mt = q, 0  # dummy pointer, never read
    else:
        mask_arg, stride_mt = tree_mask, tree_mask.stride(0)
        assert tree_mask.dtype == torch.int32 and tree_mask.stride(1) == 1
    common = (float(scale) * LOG2E,
              q.stride(0), q.stride(1), q.stride(2),
              out.stride(0), out.stride(1), out.stride(2),
              *k_cache.stride(), *v_cache.stride(),
              block_tables.stride(0), stride_mt)
    meta = dict(GROUP=group, GROUP_P2=group_p2, BLOCK_Q=block_q, HEAD_DIM=D, BLOCK_SIZE=block_size,
                BLOCK_N=block_n, PARTITION=PARTITION_SIZE, TREE_MASK=tree_mask is not None,
                PREFETCH=bool(tile.get("prefetch", False)),
                num_warps=tile["num_warps"], num_stages=tile["num_stages"], **EXACT_FP)
    if not split:
        grid = (triton.cdiv(max_query_len, block_q), Hkv, B)
        _attn_fused_kernel[grid](out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, mask_arg,
                                 *common, **meta)
        return out
    part_ml = torch.empty((2, T, Hq, num_parts), device=q.device, dtype=torch.float32)
    part_acc = torch.empty((T, Hq, num_parts, D), device=q.device, dtype=torch.float32)
    pstr = (part_ml.stride(1), part_ml.stride(2), part_acc.stride(0), part_acc.stride(1), part_acc.stride(2))
    _attn_split_kernel[(num_parts, Hkv, B)](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, mask_arg,
        part_ml[0], part_ml[1], part_acc, *common, *pstr, **meta)
    _attn_reduce_kernel[(max_query_len, Hkv, B)](
        out, seq_lens, query_start_loc, part_ml[0], part_ml[1], part_acc,
        out.stride(0), out.stride(1), out.stride(2), *pstr,
        GROUP=group, GROUP_P2=group_p2, HEAD_DIM=D, PARTITION=PARTITION_SIZE, LOAD_AHEAD=REDUCE_LOAD_AHEAD,
        num_warps=1, **EXACT_FP)
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
