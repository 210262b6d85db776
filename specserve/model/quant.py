"""Weight-only int8 linear layers for CPUs (draft heads today; the target's later).

`Int8Linear` keeps a linear layer's weights as symmetric int8 with one scale per output row
and runs torch's int8 weight-only kernel (`torch._weight_int8pack_mm`: int8 weights,
activations in the model's dtype) for products of up to `MAX_ROWS` rows, where reading the
weights dominates; longer products use the dequantized copy it keeps beside them, so every
product computes the same quantized layer up to rounding. Whether the kernel is faster than
the dtype's own GEMM depends on the CPU (on AVX512 machines it is, up to about 4 rows; on
AVX2-only ones it is slower at every size), so `int8_pays` measures it where it runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: weight [N, K] -> (int8 [N, K], scales [N] in weight's dtype)."""
    w = weight.detach().float()
    scales = w.abs().amax(1).clamp(min=1e-12) / 127
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales.to(weight.dtype)


class Int8Linear(nn.Module):
    """y = x @ dequant(W).T + b with W in int8 (see the module docstring)."""

    MAX_ROWS = 4  # up to this many rows the int8 kernel; more: the dequantized weights

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        q, scales = quantize_rows(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.register_buffer("weight", (q.float() * scales.float()[:, None]).to(weight.dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > self.MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        y = torch._weight_int8pack_mm(rows.contiguous(), self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        return cls(linear.weight, linear.bias)


def quantize_linears(module: nn.Module) -> nn.Module:
    """Replace every nn.Linear inside module (in place) with an Int8Linear; returns module."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear.from_linear(child))
        else:
            quantize_linears(child)
    return module


_INT8_PAYS: dict[tuple, bool] = {}


def int8_pays(hidden: int, intermediate: int, dtype: torch.dtype) -> bool:
    """Whether int8 weight-only products beat the dtype's GEMM on this CPU for 1 and 4 rows of
    a head-sized matrix (by 10%): AVX512 machines say yes, AVX2-only ones no. Cached."""
    import time

    key = (hidden, intermediate, dtype, torch.get_num_threads())
    if key not in _INT8_PAYS:
        weight = torch.randn(intermediate, hidden, dtype=dtype) * 0.02
        layer = Int8Linear(weight, None)
        faster = []
        for rows in (1, 4):
            x = torch.randn(rows, hidden, dtype=dtype)
            times = {}
            for name, fn in (("int8", layer), ("dense", lambda x: F.linear(x, weight))):
                fn(x)
                start = time.perf_counter()
                for _ in range(50):
                    fn(x)
                times[name] = time.perf_counter() - start
            faster.append(times["int8"] < 0.9 * times["dense"])
        _INT8_PAYS[key] = all(faster)
    return _INT8_PAYS[key]
