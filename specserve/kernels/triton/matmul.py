"""A batch-invariant linear layer: ``y = x @ weight.T + bias`` whose rows never depend on the batch.

Scope
-----
x [M, K] (rows of any stride, unit stride along K; copied otherwise), weight [N, K] (the
``nn.Linear`` layout, same dtype as x), bias [N] or None; the result is [M, N] in x's dtype.
Dtypes bfloat16, float16 and float32 (``tl.dot`` with ``input_precision="ieee"``: true float32
products, no TF32).  Products accumulate in float32.

Why it is batch-invariant
-------------------------
cuBLAS picks its kernel, its tiles and its split-K from the shape, M included: the same token's
row computed in a 1-row decode step and inside an 8-row verification step can differ in the last
bits, which breaks exactly-lossless speculative decoding on the GPU.  Here every choice that
orders a row's arithmetic is a constant:

* the tiles (``BLOCK_M`` x ``BLOCK_N`` outputs, ``BLOCK_K`` deep), ``num_warps`` and
  ``num_stages``: the same ``tl.dot`` instructions for every M, a row's products landing in
  the same accumulation order wherever it sits in its tile (rows past M load as zeros and
  touch no other row);
* the K partitions: ``[p * SPLIT_K, (p + 1) * SPLIT_K)``, a fixed length (never derived from M or
  the batch); each partition is a float32 partial product accumulated over its ``BLOCK_K``
  steps in increasing k, and the partials are summed in increasing ``p`` starting from zero,
  then the bias (float32) is added and the sum cast once.

A row's bits therefore depend only on its own x row, the weights and the constants: not on M,
not on which other rows share the batch, nor on their order.

Two launch modes give the same bits; the launcher picks one for speed only:

* split (few output tiles: decodes, verification steps): ``_linear_kernel`` with grid
  (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), num_partitions) writes each partition's float32 partial
  to a workspace [num_partitions, M, N]; ``_linear_reduce_kernel`` sums them in order, adds the
  bias and casts;
* fused (enough tiles to fill the GPU, or one partition): one program walks the partitions in
  order and sums them in registers: no workspace, no second launch.

What it costs relative to cuBLAS (``F.linear``) is measured on a GPU by ``specserve bench gpu``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._triton import EXACT_FP, HAS_TRITON, tl, triton  # noqa: F401 (HAS_TRITON re-exported)

# Output tile and depth of one tl.dot step: constants, the same for every M (what makes rows
# invariant).  64 x 64 x 64 fits Hopper's wgmma (m64) and Ampere's mma with 4 warps, and its
# 3-stage pipeline fits shared memory even in float32 (3 x 2 x 64 x 64 x 4 B = 96 KiB).
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 3
# K partition length: fixes every row's reduction order, so never derived from the batch.
SPLIT_K = 512
# Launch-mode heuristics (speed only: both modes give the same bits).
SPLIT_MAX_TILES = 256  # output tiles below which the partitions run in parallel (split mode)
SPLIT_MAX_BYTES = 256 << 20  # largest float32 workspace split mode may allocate
REDUCE_BLOCK = 1024  # outputs per program of the reduction


@triton.jit
def _partition(x_rows, w_cols, m_ok, n_ok, p, K,
               SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Partial product of K partition p: float32 [BLOCK_M, BLOCK_N] over k in
    # [p * SPLIT_K, min((p + 1) * SPLIT_K, K)) in BLOCK_K steps of increasing k; the one
    # partition both modes use.  Each step loads BLOCK_M x BLOCK_K of x, BLOCK_K x BLOCK_N of w.
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = p * SPLIT_K
    k_hi = tl.minimum(k_lo + SPLIT_K, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < k_hi
        a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        b = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
        if UPCAST:  # the interpreter's dot cannot multiply bfloat16; float32 holds their products exactly
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N] (only read when HAS_BIAS)
    out_ptr,  # [M, N] contiguous, x's dtype (fused mode)
    ws_ptr,  # float32 [num_partitions, M, N] (split mode)
    M, N, K,
    stride_xm, stride_wn,
    HAS_BIAS: tl.constexpr, FUSED: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), num_partitions if split else 1).
    # M is never specialised: one compiled kernel (the same code) for every batch size.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BN]
    out_off = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    out_ok = m_ok[:, None] & n_ok[None, :]
    if FUSED:
        # The partitions in increasing order, summed from zero in registers as the reduction
        # sums the workspace: the same float32 additions in the same order.
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for p in range(0, tl.cdiv(K, SPLIT_K)):
            total += _partition(x_rows, w_cols, m_ok, n_ok, p, K, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
                                UPCAST)
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_off, total.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        p = tl.program_id(2)
        acc = _partition(x_rows, w_cols, m_ok, n_ok, p, K, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
                         UPCAST)
        # one float32 partial: BLOCK_M x BLOCK_N stores
        tl.store(ws_ptr + p.to(tl.int64) * M * N + out_off, acc, mask=out_ok)


@triton.jit(do_not_specialize=["M"])
def _linear_reduce_kernel(
    ws_ptr,  # float32 [num_partitions, M, N]
    bias_ptr,  # [N] (only read when HAS_BIAS)
    out_ptr,  # [M, N] contiguous
    M, N, num_partitions,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    # grid = (cdiv(M * N, BLOCK),): each output is its partials summed from zero in increasing
    # partition order (num_partitions float32 loads), + bias, cast once.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    size = M.to(tl.int64) * N
    ok = offs < size
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for p in range(0, num_partitions):
        total += tl.load(ws_ptr + p * size + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def _check(x, weight, bias, split_k: int):
    assert x.dim() == 2 and weight.dim() == 2, "x must be [M, K] and weight [N, K]"
    assert x.shape[1] == weight.shape[1], f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: K differs"
    assert x.dtype == weight.dtype, f"x is {x.dtype} but weight is {weight.dtype}"
    assert bias is None or bias.shape == (weight.shape[0],), "bias must be [N]"
    assert split_k > 0 and split_k % BLOCK_K == 0, f"split_k must be a positive multiple of {BLOCK_K}"


def linear_invariant_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                            split_k: int = SPLIT_K, split: Optional[bool] = None) -> torch.Tensor:
    """x [M, K], weight [N, K], bias [N] or None -> [M, N] in x's dtype; each row's bits are
    independent of M and of the other rows.  `split` forces a launch mode (tests; both give the
    same bits), None picks one by the size of the output."""
    _check(x, weight, bias, split_k)
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"unsupported dtype {x.dtype}"
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.copy_(bias.float().expand(M, N) if bias is not None else torch.zeros_like(out))
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    num_partitions = triton.cdiv(K, split_k)
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    if split is None:
        split = num_partitions > 1 and tiles < SPLIT_MAX_TILES and num_partitions * M * N * 4 <= SPLIT_MAX_BYTES
    # Half-precision operands go to tl.dot as they are on the GPU; on the CPU (the Triton interpreter,
    # tests) they are upcast to float32 first, exactly, since the interpreter cannot multiply bfloat16.
    upcast = x.device.type == "cpu" and x.dtype != torch.float32
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"  # (only float32 operands read it)
    has_bias = bias is not None
    bias_arg = bias if has_bias else out  # never read
    consts = dict(HAS_BIAS=has_bias, SPLIT_K=split_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                  PRECISION=precision, UPCAST=upcast, num_warps=NUM_WARPS, num_stages=NUM_STAGES, **EXACT_FP)
    if not split:
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), 1)
        _linear_kernel[grid](x, weight, bias_arg, out, out, M, N, K, x.stride(0), weight.stride(0),
                             FUSED=True, **consts)
        return out
    ws = torch.empty((num_partitions, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), num_partitions)
    _linear_kernel[grid](x, weight, bias_arg, out, ws, M, N, K, x.stride(0), weight.stride(0),
                         FUSED=False, **consts)
    _linear_reduce_kernel[(triton.cdiv(M * N, REDUCE_BLOCK),)](
        ws, bias_arg, out, M, N, num_partitions, HAS_BIAS=has_bias, BLOCK=REDUCE_BLOCK, num_warps=4, **EXACT_FP,
    )
    return out


def linear_invariant_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                         split_k: int = SPLIT_K) -> torch.Tensor:
    """The PyTorch reference of linear_invariant_triton, the same structure: per K partition a
    float32 product, summed from zero in partition order, + bias in float32, cast once.  It
    agrees with the kernel within rounding, not bit for bit (the products inside a partition
    are PyTorch's matmul)."""
    _check(x, weight, bias, split_k)
    M, K = x.shape
    total = torch.zeros((M, weight.shape[0]), dtype=torch.float32, device=x.device)
    for k0 in range(0, K, split_k):
        total = total + x[:, k0:k0 + split_k].float() @ weight[:, k0:k0 + split_k].float().T
    if bias is not None:
        total = total + bias.float()
    return total.to(x.dtype)
