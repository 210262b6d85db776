"""A batch-invariant RMSNorm: ``weight * (x / sqrt(mean(x^2) + eps))`` whose rows never depend on the batch.

Scope
-----
x [M, N] (unit stride along N; copied otherwise), weight [N], both of one dtype (bfloat16,
float16 or float32); the result is [M, N] in that dtype.  The arithmetic is the model's RMSNorm
(model/llama.py): the row in float32, normalised, rounded to the dtype, then multiplied by the
weight and rounded again.

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
from ._triton import next_pow2

NUM_WARPS = 4


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    # grid = (M,): one program per row; the row in float32, its sum of squares one tl.sum.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, 0) / N
    y = (x / tl.sqrt_rn(mean_sq + eps)).to(out_ptr.dtype.element_ty)  # rounded as the model rounds
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_invariant_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, N], weight [N] -> [M, N] in x's dtype; each row's bits independent of M."""
    assert x.dim() == 2 and weight.shape == (x.shape[1],), "x must be [M, N] and weight [N]"
    assert x.dtype == weight.dtype, f"x is {x.dtype} but weight is {weight.dtype}"
    M, N = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if M == 0 or N == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    _rms_norm_kernel[(M,)](x, weight.contiguous(), out, N, x.stride(0), out.stride(0), float(eps),
                           BLOCK=next_pow2(N), num_warps=NUM_WARPS)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm in PyTorch (any shape [..., N]): the reference of the kernel, within
    rounding (its sum of squares is PyTorch's)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)
