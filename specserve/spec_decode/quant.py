"""Draft-head weight formats (speculative_config "quantization": "auto" | "gguf" | "int8" |
"none").

A head's passes are a few rows each. On a float32 CPU model where products with int8
activations against Q8_0 blocks (cpu_linear.pack_a8, what `--quantization gguf` runs; AVX512-VNNI
or AVX2) beat the head's other formats at 1, 4 and 16 rows (specserve.model.quant.a8_pays,
measured at start), every product of the head, its LM head's included, runs that way ("gguf",
`A8`). Else, on a CPU whose int8 weight-only kernel beats the model's dtype at a few rows
(specserve.model.quant.int8_rows) its linear layers and its LM head run in int8 up to the row
count where int8 stops paying (larger passes, a prompt's catch-up or many requests' nodes, in
the model's dtype); else, on a CPU float32 model where our float32 kernel beats PyTorch's GEMM
(specserve.model.quant.f32_kernel_pays), through that, and otherwise through PyTorch's over
transposed weights. Only the drafts change: verification uses the target's exact
distribution, so output stays lossless whatever the draft proposes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.quant import Int8Linear, a8_pays, f32_kernel_pays, int8_rows, quantize_linears

INT8_ALWAYS = 1 << 30  # check_quantization's answer for "int8": every product in int8
A8 = -1  # ... for "gguf": every product with int8 activations against Q8_0 blocks (cpu_linear.pack_a8)


def draft_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantize: int, f32_kernel: bool):
    """One product of a draft as drafting runs it, a callable [rows, K] -> [rows, N]: with int8
    activations against Q8_0 blocks (quantize A8), int8 weights for products of up to
    `quantize` rows (0: never; INT8_ALWAYS: always; see check_quantization), else our float32
    kernel (f32_kernel: see `f32_kernel_for`) or PyTorch's. (A8 with a reduction length that
    is not whole blocks of 32, e.g. an o projection of heads x head_dim columns: the float path.)"""
    if quantize == A8:
        from specserve.kernels.cpu.cpu_linear import QK, pack_a8

        return pack_a8(weight, bias) if weight.shape[1] % QK == 0 else draft_linear(weight, bias, 0, f32_kernel)
    if quantize:
        int8 = Int8Linear(weight, bias)
        if quantize >= INT8_ALWAYS:
            return int8
        dense = draft_linear(weight, bias, 0, f32_kernel)
        return lambda x: int8(x) if x.shape[0] <= quantize else dense(x)
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
    return _f32_kernel(weight.device, weight.dtype, hidden, intermediate)


def _f32_kernel(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    from specserve.kernels.cpu import cpu_linear

    return (device.type == "cpu" and dtype == torch.float32 and cpu_linear.available()
            and f32_kernel_pays(hidden, intermediate))


def draft_lm_head(heads: nn.Module | None, weight: torch.Tensor, d2t: torch.Tensor | None, quantize: int,
                  f32_kernel: bool = False):
    """A draft's LM head as its proposer uses it: the target's LM head weight [V, hidden],
    restricted to the draft vocabulary d2t when there is one; with quantize, it in int8 as
    draft_linear runs it and every nn.Linear of heads (in place; None: no other layers) in int8. Returns (the LM head, a
    callable [rows, hidden] -> [rows, N]; d2t on the weight's device or None). No gradient
    ever flows through it (proposers draft without a grad-mode context)."""
    weight = weight.detach()
    if d2t is not None:
        d2t = d2t.to(weight.device, torch.int64).contiguous()  # (the C top-k reads it as such)
        weight = weight.index_select(0, d2t)
    if quantize and heads is not None:  # (Medusa's heads: int8 weights, whatever the LM head's format)
        quantize_linears(heads)
    if quantize or f32_kernel:
        return draft_linear(weight, None, quantize, f32_kernel), d2t
    weight_t = weight.t().contiguous()  # [hidden, N]: skinny products read it faster
    return (lambda x: x @ weight_t), d2t


def check_quantization(value, device: torch.device, hidden: int, intermediate: int,
                       dtype: torch.dtype) -> int:
    """speculative_config "quantization" -> the draft head's products: A8 (int8 activations
    against Q8_0 blocks), else up to how many rows they run in int8 (0: none, INT8_ALWAYS: all).
    "auto" (the default): on a CPU, as far as `int8_rows` measures int8 faster than the products
    the head would otherwise run (f32_kernel_for, draft_linear) for a head of this shape, and A8
    instead where a float32 head's products measure faster so (`a8_pays`); none elsewhere."""
    from specserve.kernels.cpu import cpu_linear

    value = "auto" if value is None else value  # one of auto, gguf, int8, none (SpecConfig checks)
    a8_fits = (device.type == "cpu" and dtype == torch.float32 and cpu_linear.a8_available()
               and hidden % cpu_linear.QK == 0 and intermediate % cpu_linear.QK == 0)
    if value in ("int8", "gguf") and device.type != "cpu":
        raise ValueError(f"speculative_config.quantization: {value!r} runs on the CPU only")
    if value == "gguf" and not a8_fits:
        raise ValueError("speculative_config.quantization: 'gguf' needs a float32 model on an x86 CPU with "
                         "AVX2 and hidden and intermediate sizes that are multiples of 32")
    if value != "auto":
        return {"gguf": A8, "int8": INT8_ALWAYS}.get(value, 0)
    if device.type != "cpu":
        return 0
    f32_kernel = _f32_kernel(device, dtype, hidden, intermediate)
    rows = int8_rows(hidden, intermediate, dtype, lambda w: draft_linear(w, None, 0, f32_kernel))
    if a8_fits and a8_pays(hidden, intermediate, lambda w: draft_linear(w, None, rows, f32_kernel)):
        return A8
    return rows
