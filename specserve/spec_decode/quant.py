"""Draft-head weight formats (speculative_config "quantization": "auto" | "int8" | "none").

A head's passes are a few rows each, so on a CPU whose int8 weight-only kernel beats the
model's dtype at a few rows (specserve.model.quant.int8_pays, measured at start) its linear
layers and its LM head run in int8; else, on a CPU float32 model where our float32 kernel beats
PyTorch's GEMM (specserve.model.quant.f32_kernel_pays, measured at start), through that, and
otherwise through PyTorch's over transposed weights. Only the drafts change: verification uses
the target's exact distribution, so output stays lossless whatever the draft proposes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.quant import Int8Linear, f32_kernel_pays, int8_pays, quantize_linears


def draft_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantize: bool, f32_kernel: bool):
    """One product of a draft as drafting runs it, a callable [rows, K] -> [rows, N]: int8
    (quantize), our float32 kernel (f32_kernel: see `f32_kernel_for`) or PyTorch's."""
    if quantize:
        return Int8Linear(weight, bias)
    if f32_kernel:
        from specserve.kernels.cpu.cpu_linear import pack_float32

        return pack_float32(weight, bias)
    weight, bias = weight.detach(), None if bias is None else bias.detach()
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        # MKL multiplies 4-16 rows by a [K, N] weight about twice as fast as by nn.Linear's
        # [N, K] (the same at 1-3 rows and from 64); a draft's catch-up and its passes under
        # load are such row counts (docs/eagle.md)
        weight_t = weight.t().contiguous()
        return (lambda x: x @ weight_t) if bias is None else (lambda x: torch.addmm(bias, x, weight_t))
    return lambda x: F.linear(x, weight, bias)


def f32_kernel_for(weight: torch.Tensor, hidden: int, intermediate: int) -> bool:
    """Whether a draft's float32 products on this CPU go through our kernel: where a
    measurement at start (cached) found it faster than PyTorch's GEMM (a target's go through
    it regardless: LlamaForCausalLM.finalize_weights)."""
    from specserve.kernels.cpu import cpu_linear

    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and cpu_linear.available()
            and f32_kernel_pays(hidden, intermediate))


def draft_lm_head(heads: nn.Module | None, weight: torch.Tensor, d2t: torch.Tensor | None, quantize: bool,
                  f32_kernel: bool = False):
    """A draft's LM head as its proposer uses it: the target's LM head weight [V, hidden],
    restricted to the draft vocabulary d2t when there is one; with quantize, it and every
    nn.Linear of heads (in place; None: no other layers) in int8. Returns (the LM head, a
    callable [rows, hidden] -> [rows, N]; d2t on the weight's device or None). No gradient
    ever flows through it (proposers draft without a grad-mode context)."""
    weight = weight.detach()
    if d2t is not None:
        d2t = d2t.to(weight.device, torch.int64).contiguous()  # (the C top-k reads it as such)
        weight = weight.index_select(0, d2t)
    if quantize and heads is not None:
        quantize_linears(heads)
    if quantize or f32_kernel:
        return draft_linear(weight, None, quantize, f32_kernel), d2t
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
