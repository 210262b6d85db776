"""Draft-head weight formats (speculative_config "quantization": "auto" | "int8" | "none").

A head's passes are a few rows each, so on a CPU whose int8 weight-only kernel beats the
model's dtype at a few rows (specserve.model.quant.int8_pays, measured at start) its linear
layers and its LM head run in int8. Only the drafts change: verification uses the target's
exact distribution, so output stays lossless whatever the draft proposes.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.model.quant import Int8Linear, int8_pays, quantize_linears


def draft_lm_head(heads: nn.Module, weight: torch.Tensor, d2t: torch.Tensor | None, quantize: bool):
    """A draft's weights as its proposer uses them: the target's LM head weight [V, hidden],
    restricted to the draft vocabulary d2t when there is one; with quantize, it and every
    nn.Linear of heads (in place) in int8. Returns (the LM head, a callable [rows, hidden] ->
    [rows, N]; d2t on the weight's device or None)."""
    if d2t is not None:
        d2t = d2t.to(weight.device)
        weight = weight.index_select(0, d2t)
    if quantize:
        quantize_linears(heads)
        return Int8Linear(weight, None), d2t
    weight_t = weight.t().contiguous()  # [hidden, N]: skinny products read it faster
    return (lambda x: x @ weight_t), d2t


def check_quantization(value, device: torch.device, hidden: int, intermediate: int,
                       dtype: torch.dtype) -> bool:
    """speculative_config "quantization" -> whether to quantize the draft head. "auto" (the
    default): on a CPU, int8 where `int8_pays` measures it faster than the model's dtype for a
    head of this shape; off elsewhere."""
    value = "auto" if value is None else value  # one of auto, int8, none (SpecConfig checks)
    if value == "int8" and device.type != "cpu":
        raise ValueError("speculative_config.quantization: 'int8' runs on the CPU only")
    if value == "auto":
        return device.type == "cpu" and int8_pays(hidden, intermediate, dtype)
    return value == "int8"
