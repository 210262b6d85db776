"""A batch-invariant RMSNorm: ``weight * (x / sqrt(mean(x^2) + eps))`` whose rows never depend on the batch.

Scope
-----
x [M, N] (unit stride along N; copied otherwise), weight [N], both of one dtype (bfloat16,
float16 or float32); the result is [M, N] in that dtype.  The arithmetic is the model's RMSNorm
(model/llama.py): the row in float32, normalised, rounded to the dtype, then multiplied by the
weight and rounded again.  ``add_rms_norm_invariant_triton`` first adds a residual (the sum
rounded to the dtype, returned too), as a decoder layer's norms do: one launch for both.

Why it is batch-invariant
-------------------------
PyTorch's reduction kernels choose how many threads share a row from the tensor's shape, the
number of rows included, and inductor's generated reductions choose their tiles per compiled
graph: the same token's row in a 1-row decode step and inside a verification step can then sum
its squares in another order.  Here one program holds one whole row (``BLOCK`` = the next
power of two of N, ``NUM_WARPS`` warps, both fixed by N alone), so a row's sum is the same
``tl.sum`` tree whatever M is and whichever rows share the launch.
"""
from __future__ import annotations

import torch

from ._triton import HAS_TRITON, tl, triton  # noqa: F401 (HAS_TRITON re-exported)
from ._triton import EXACT_FP, next_pow2

NUM_WARPS = 4


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, sum_ptr, w_ptr, out_ptr, N, stride_x, stride_r, stride_s, stride_o, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # grid = (M,): one program per row; the row in float32, its sum of squares one tl.sum.
    # HAS_RESIDUAL: the row is x + residual, rounded to the dtype (as the model adds them) and
    # stored to sum_ptr, then normalised.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=ok)
    x = x.to(tl.float32)
    mean_sq = tl.sum(x * x, 0) / N
    y = (x / tl.sqrt_rn(mean_sq + eps)).to(out_ptr.dtype.element_ty)  # rounded as the model rounds
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    assert x.dim() == 2 and weight.shape == (x.shape[1],), "x must be [M, N] and weight [N]"
    assert x.dtype == weight.dtype, f"x is {x.dtype} but weight is {weight.dtype}"
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype), \
        "residual: x's shape and dtype"
    M, N = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    total = None if residual is None else torch.empty_like(out)
    if M == 0 or N == 0:
        return out, total
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    r, t = (x, out) if residual is None else (residual, total)  # (never read / written without one)
    _rms_norm_kernel[(M,)](x, r, t, weight.contiguous(), out, N, x.stride(0), r.stride(0), t.stride(0),
                           out.stride(0), float(eps), HAS_RESIDUAL=residual is not None,
                           BLOCK=next_pow2(N), num_warps=NUM_WARPS, **EXACT_FP)
    return out, total


def rms_norm_invariant_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, N], weight [N] -> [M, N] in x's dtype; each row's bits independent of M."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm_invariant_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) with s = x + residual rounded to x's dtype, in one launch ([M, N] each)."""
    return _launch(x, residual, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm in PyTorch (any shape [..., N]): the reference of the kernel, within
    rounding (its sum of squares is PyTorch's)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return rms_norm_ref(total, weight, eps), total
