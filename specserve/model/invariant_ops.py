"""The batch-invariant ops as registered ops, `specserve::linear_invariant` and
`specserve::rms_norm_invariant`: traced by `torch.compile(fullgraph=True)` as one node each (the
fake implementations give the shapes) and replayed in CUDA graphs. They run specserve.kernels'
dispatch: the Triton kernels (kernels/triton/matmul.py, kernels/triton/rms_norm.py) on CUDA, the
PyTorch references elsewhere. `Linear` and `RMSNorm` (model/llama.py) call them where the model
config asks for batch invariance on CUDA (`--batch-invariant`)."""

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
