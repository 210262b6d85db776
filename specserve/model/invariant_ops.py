"""The batch-invariant ops as registered ops: `specserve::linear_invariant`,
`specserve::rms_norm_invariant` and `specserve::add_rms_norm_invariant` (the norms, the second
adding the residual first), `specserve::rotary_invariant` and `specserve::silu_mul_invariant` (a
layer's elementwise steps in one launch each). Traced by `torch.compile(fullgraph=True)` as one
node each (the fake implementations give the shapes) and replayed in CUDA graphs. They run
specserve.kernels' dispatch: the Triton kernels (kernels/triton/matmul.py, rms_norm.py,
fused.py) on CUDA, the PyTorch references elsewhere. `Linear`, `RMSNorm`, `Attention` and `MLP`
(model/llama.py) call them where the model config asks for batch invariance on CUDA
(`--batch-invariant`): a decoder layer's arithmetic is then all inside these ops and the
attention's, so the compiled step (which only orders them) and an eager step past the buckets
compute the same bits (model/compiled.py)."""

from __future__ import annotations

from typing import Optional

import torch

from specserve import kernels


@torch.library.custom_op("specserve::linear_invariant", mutates_args=())
def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T + bias -> [M, N]; each row's bits independent of M."""
    return kernels.linear_invariant(x, weight, bias)


@linear_invariant.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("specserve::rms_norm_invariant", mutates_args=())
def rms_norm_invariant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over x's last dimension ([..., N], weight [N]); each row's bits independent of
    the other rows."""
    n = x.shape[-1]
    return kernels.rms_norm_invariant(x.reshape(-1, n), weight, eps).view(x.shape)


@rms_norm_invariant.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("specserve::add_rms_norm_invariant", mutates_args=())
def add_rms_norm_invariant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) over the last dimension, one launch."""
    n = x.shape[-1]
    normed, total = kernels.add_rms_norm_invariant(x.reshape(-1, n), residual.reshape(-1, n), weight, eps)
    return normed.view(x.shape), total.view(x.shape)


@add_rms_norm_invariant.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("specserve::rotary_invariant", mutates_args=())
def rotary_invariant(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                     head_dim: int) -> torch.Tensor:
    """The first `heads` heads of qkv [T, W] rotated -> [T, heads, head_dim]."""
    return kernels.rotary(qkv, cos, sin, heads, head_dim)


@rotary_invariant.register_fake
def _(qkv, cos, sin, heads, head_dim):
    return qkv.new_empty((qkv.shape[0], heads, head_dim))


@torch.library.custom_op("specserve::silu_mul_invariant", mutates_args=())
def silu_mul_invariant(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x [T, 2I] (gate then up) -> [T, I]."""
    return kernels.silu_mul(x)


@silu_mul_invariant.register_fake
def _(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))
