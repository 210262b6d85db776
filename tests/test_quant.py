"""Weight-only int8 linear layers (specserve.model.quant) and draft-head formats (specserve.spec_decode.quant)."""

import pytest
import torch
from torch import nn

from specserve.model.arch import ModelArch
from specserve.spec_decode.eagle_head import EagleHead
from specserve.spec_decode.medusa import MedusaHeads
from specserve.model.quant import Int8Linear, int8_pays, quantize_linears, quantize_rows
from specserve.spec_decode.quant import check_quantization


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_rows_round_trip_within_half_a_step():
    w = torch.randn(48, 80) * torch.linspace(0.01, 3, 48)[:, None]  # rows of very different sizes
    q, scales = quantize_rows(w)
    assert q.dtype == torch.int8 and scales.shape == (48,)
    assert int(q.abs().amax(1).min()) == 127  # every row uses its whole range
    assert torch.all((q.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, Int8Linear.MAX_ROWS, Int8Linear.MAX_ROWS + 1, 19])
def test_int8_linear_tracks_the_full_precision_layer(dtype, rows):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160).to(dtype)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(rows, 96, dtype=dtype)
    assert rel_err(q(x), lin(x)) < 0.02
    if rows <= Int8Linear.MAX_ROWS:  # few rows go through the int8 kernel
        assert torch.equal(q(x), torch._weight_int8pack_mm(x, q.qweight, q.scales) + q.bias)
    # the int8 kernel (few rows) and the dequantized weights (many rows) are one model
    deq = nn.functional.linear(x, q.weight, q.bias)
    assert rel_err(q(x), deq) < 0.01
    assert q(x[None]).shape == (1, rows, 160)


def test_quantize_linears_replaces_every_linear_of_a_head():
    arch = ModelArch.from_dict({"hidden_size": 64, "intermediate_size": 128, "vocab_size": 96,
                                "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2})
    eagle, medusa = EagleHead(arch), MedusaHeads(3, 1, 64, vocab=96)
    x = torch.randn(1, 2, 64)
    want = eagle(x, x, torch.arange(2))[0]
    for module in (eagle, medusa):
        quantize_linears(module)
        assert not any(type(m) is nn.Linear for m in module.modules())
        assert any(isinstance(m, Int8Linear) for m in module.modules())
    assert rel_err(eagle(x, x, torch.arange(2))[0], want) < 0.02
    assert medusa.logits(x[0], None).shape == (3, 2, 96)


def test_quantization_option_is_checked():
    cpu, gpu, shape = torch.device("cpu"), torch.device("cuda"), (64, 128, torch.float32)
    # auto: measured on a CPU (whichever way it goes here), never on a GPU
    assert check_quantization(None, cpu, *shape) == int8_pays(*shape) == check_quantization("auto", cpu, *shape)
    assert not check_quantization(None, gpu, *shape)
    assert check_quantization("int8", cpu, *shape) and not check_quantization("none", cpu, *shape)
    with pytest.raises(ValueError, match="expected one of auto, int8, none"):
        check_quantization("fp8", cpu, *shape)
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization("int8", gpu, *shape)
