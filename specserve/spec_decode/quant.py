"""Weight-only int8 for draft heads (speculative_config "quantization": "int8").

A draft head's passes are a few rows each (the committed tokens of the last step, then at most
top-k tree nodes per depth), so their matrix products are dominated by reading weights. On a
CPU, torch's int8 weight-only kernel (`torch._weight_int8pack_mm`: int8 weights, one scale per
output row, activations in the model's dtype) runs such products 1.5-4x faster than the
bfloat16 GEMM for up to about 4 rows and slower from about 8 (`benchmarks/draft_int8.py`). So
`Int8Linear` keeps both: the int8 weights for passes of up to `MAX_ROWS` rows and their
dequantized copy for longer ones (a prompt's first head pass), so every pass computes the same
quantized model up to rounding.

Only the draft changes: verification uses the target's exact distribution, so output stays
lossless whatever the draft proposes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("auto", "int8", "none")


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


def draft_lm_head(heads: nn.Module, lm_weight: torch.Tensor, quantize: bool):
    """A draft's weights as its proposer uses them: with quantize, every nn.Linear of heads is
    made int8 in place and so is the (maybe restricted) LM head lm_weight [N, hidden].
    Returns the LM head, a callable [rows, hidden] -> [rows, N]."""
    if quantize:
        quantize_linears(heads)
        return Int8Linear(lm_weight, None)
    weight_t = lm_weight.t().contiguous()  # [hidden, N]: skinny products read it faster
    return lambda x: x @ weight_t


def check_quantization(value, device: torch.device, hidden: int, intermediate: int,
                       dtype: torch.dtype) -> bool:
    """speculative_config "quantization" -> whether to quantize the draft head. "auto" (the
    default): on a CPU, int8 where `int8_pays` measures it faster than the model's dtype for a
    head of this shape; off elsewhere."""
    value = "auto" if value is None else value
    if value not in QUANTIZATIONS:
        raise ValueError(f"speculative_config.quantization: expected one of {', '.join(QUANTIZATIONS)}, "
                         f"got {value!r}")
    if value == "int8" and device.type != "cpu":
        raise ValueError("speculative_config.quantization: 'int8' runs on the CPU only")
    if value == "auto":
        return device.type == "cpu" and int8_pays(hidden, intermediate, dtype)
    return value == "int8"


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
