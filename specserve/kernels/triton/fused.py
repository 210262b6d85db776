"""A decoder layer's elementwise steps as single launches: rotary embedding of q and k, and
SiLU(gate) x up. Each output element depends on its own row's inputs only (no reduction), so
the results are batch-invariant by construction; what these save is launches: the PyTorch
forms take seven kernels per rotated tensor and two for the MLP's activation, which in a
graph-replayed step without the compiler's fusion (`--batch-invariant`) cost more than the
arithmetic. Both compute in float32 and round once to the inputs' dtype.

Scope
-----
* ``rotary_triton(qkv, cos, sin, heads, head_dim)``: qkv [T, W] (rows of heads x head_dim
  values, q's heads then k's then v's; unit stride along W), cos / sin [T, 1, head_dim / 2]
  (the model's rotary table for the step's positions, any dtype) -> the first `heads` heads
  rotated (rotate-half form), [T, heads, head_dim].
* ``silu_mul_triton(x)``: x [T, 2I] (gate then up) -> silu(gate) * up, [T, I].
"""
from __future__ import annotations

import torch

from ._triton import HAS_TRITON, tl, triton  # noqa: F401 (HAS_TRITON re-exported)
from ._triton import EXACT_FP, next_pow2

SILU_BLOCK = 1024


@triton.jit
def _rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, out_ptr, stride_x, stride_c, stride_s, stride_ot, stride_oh,
                   HALF: tl.constexpr, HALF_P2: tl.constexpr):
    # grid = (T, heads): one head of one row.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, HALF_P2)
    ok = offs < HALF
    base = qkv_ptr + t * stride_x + h * 2 * HALF
    x1 = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_c + offs, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_s + offs, mask=ok, other=0.0).to(tl.float32)
    out = out_ptr + t * stride_ot + h * stride_oh
    tl.store(out + offs, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out + HALF + offs, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    # grid = (T, cdiv(inter, BLOCK))
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    g = tl.load(x_ptr + t * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + inter + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=ok)


def _check_rotary(qkv, cos, sin, heads: int, head_dim: int) -> None:
    T = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.shape[1] >= heads * head_dim and head_dim % 2 == 0, "qkv [T, >= heads x head_dim]"
    assert cos.shape == sin.shape == (T, 1, head_dim // 2), f"cos / sin must be [{T}, 1, {head_dim // 2}]"


def rotary_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    _check_rotary(qkv, cos, sin, heads, head_dim)
    T = qkv.shape[0]
    out = torch.empty((T, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if T == 0 or heads == 0:
        return out
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    cos, sin = cos.reshape(T, -1), sin.reshape(T, -1)
    cos, sin = (t if t.stride(1) == 1 else t.contiguous() for t in (cos, sin))
    half = head_dim // 2
    _rotary_kernel[(T, heads)](qkv, cos, sin, out, qkv.stride(0), cos.stride(0), sin.stride(0),
                               out.stride(0), out.stride(1), HALF=half, HALF_P2=next_pow2(half), num_warps=1,
                               **EXACT_FP)
    return out


def rotary_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch (float32, one rounding)."""
    _check_rotary(qkv, cos, sin, heads, head_dim)
    x = qkv[:, :heads * head_dim].float().view(-1, heads, head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.float(), sin.float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(qkv.dtype)


def silu_mul_triton(x: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and x.shape[1] % 2 == 0, "x must be [T, 2I]"
    T, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    if T == 0 or inter == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    block = min(SILU_BLOCK, next_pow2(inter))
    _silu_mul_kernel[(T, triton.cdiv(inter, block))](x, out, inter, x.stride(0), out.stride(0), BLOCK=block,
                                                      num_warps=4, **EXACT_FP)
    return out


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch (float32, one rounding)."""
    g, u = x.float().chunk(2, dim=-1)
    return (g / (1.0 + torch.exp(-g)) * u).to(x.dtype)
