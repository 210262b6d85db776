"""The batch-invariant linear layer as a registered op, `specserve::linear_invariant`: traced
by `torch.compile(fullgraph=True)` as one node (its fake implementation gives the shape) and
replayed in CUDA graphs. It runs specserve.kernels' dispatch: the Triton kernel
(kernels/triton/matmul.py) on CUDA, the PyTorch reference elsewhere. `Linear` (model/llama.py)
calls it where the model config asks for batch invariance on CUDA (`--batch-invariant`)."""

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
