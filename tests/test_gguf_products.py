"""`--quantization gguf`: products with int8 activations against GGUF Q4_1 / Q8_0 blocks
(specserve/kernels/cpu/a8_linear.c, cpu_linear.pack_a8, LlamaForCausalLM.use_gguf_products)."""

import argparse

import pytest
import torch

from specserve.kernels.cpu import cpu_linear
from specserve.model import quant
from test_quant import gguf_like, rel_err

pytestmark = pytest.mark.skipif(not (cpu_linear.available() and cpu_linear.a8_available()),
                                reason=f"the CPU kernels cannot run here ({cpu_linear.a8_why_unavailable()})")


def a8_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What a8_linear.c computes, in float64 from the same integers: each row's blocks of 32
    quantized to int8 (round(x * 127 / max |x|), ties to even), the weights' blocks as GGUF
    stores them (Q4_1 where they are such blocks, else Q8_0, exact or quantized), one integer
    sum a block."""
    n, k = weight.shape
    w = weight.reshape(n, k // 32, 32)
    found = cpu_linear._q4_1_blocks(w)
    if found is not None:
        d, m, q = (t.double() for t in found)
    else:
        d, q = (t.double() for t in (cpu_linear._q8_0_blocks(w) or cpu_linear._q8_0_quantize(w)))
        m = torch.zeros_like(d)
    xb = x.reshape(x.shape[0], k // 32, 32)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))  # float32, as the kernel
    xq = torch.round(xb * inv[..., None]).double()
    dx = (amax / 127).double()
    isum = torch.einsum("mbk,nbk->mnb", xq, q)  # exact integers
    y = (isum * d[None] * dx[:, None]).sum(-1) + (m[None] * xb.double().sum(-1)[:, None]).sum(-1)
    return y if bias is None else y + bias.double()


@pytest.fixture(params=["avx2", "vnni"])
def a8_isa(request):
    """The products with AVX2, then with AVX512-VNNI (where the CPU has it); the kernel's own
    choice restored after."""
    was = cpu_linear.a8_vnni()
    if not cpu_linear.a8_vnni(request.param == "vnni") and request.param == "vnni":
        cpu_linear.a8_vnni(was)
        pytest.skip("no AVX512-VNNI on this CPU")
    yield request.param
    cpu_linear.a8_vnni(was)


@pytest.mark.parametrize("fmt, shape", [("q4_1", (200, 576)), ("q8_0", (130, 160)), ("f32", (70, 96))])
def test_products_are_the_documented_arithmetic_and_close_to_float32(fmt, shape, a8_isa):
    torch.manual_seed(0)
    n, k = shape
    w = torch.randn(n, k) * 0.05 if fmt == "f32" else gguf_like(fmt, n, k)
    bias = torch.randn(n)
    packed = cpu_linear.pack_a8(w, bias)
    assert packed.format == ("q8_0" if fmt == "f32" else fmt)  # weights that are not blocks: Q8_0
    x = torch.randn(9, k) * torch.linspace(0.1, 4, k)  # channels of different sizes
    x[3, 40:72] = 0  # a block of zeros (scale 0)
    y = packed(x)
    assert y.shape == (9, n) and y.dtype == torch.float32
    assert rel_err(y, a8_reference(x, w, bias)) < 1e-6
    assert rel_err(y, x @ w.T + bias) < 0.02  # int8 activations: close to float32, not equal


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_isa(fmt):
    """Every row count (each tile shape and grouping of rows), a row alone or among others, with
    AVX2 or AVX512-VNNI: the same bits; columns past the last whole vector too."""
    torch.manual_seed(1)
    w = gguf_like(fmt, 150, 224, seed=3)
    packed = cpu_linear.pack_a8(w, torch.randn(150))
    x = torch.randn(40, 224)
    alone = torch.cat([packed(x[i:i + 1]) for i in range(40)])
    was = cpu_linear.a8_vnni()
    try:
        for vnni in (False, True):
            if vnni and not cpu_linear.a8_vnni(True):
                continue
            cpu_linear.a8_vnni(vnni)
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, 40):
                assert torch.equal(packed(x[:rows]), alone[:rows]), (vnni, rows)
            assert torch.equal(packed(x[7:30]), alone[7:30])  # wherever a row sits in the batch
    finally:
        cpu_linear.a8_vnni(was)


def test_pack_a8_refuses_what_is_not_whole_blocks_or_finite():
    with pytest.raises(ValueError, match="not a multiple of 32"):
        cpu_linear.pack_a8(torch.randn(16, 40), None)
    w = torch.randn(16, 64)
    w[3, 5] = float("inf")
    with pytest.raises(ValueError, match="not all finite"):
        cpu_linear.pack_a8(w, None)


def test_the_a8_isa_is_measured_and_set(monkeypatch):
    """pick_a8_vnni times AVX512-VNNI against AVX2 where the CPU has it and keeps the faster;
    kept to AVX2 (ATEN_CPU_CAPABILITY=avx2), it measures nothing."""
    layers = [cpu_linear.pack_a8(gguf_like("q4_1", 192, 128, seed), None) for seed in range(2)]
    was = cpu_linear.a8_vnni()
    try:
        monkeypatch.setattr(quant, "_VNNI", [])
        assert quant.pick_a8_vnni(layers) == cpu_linear.a8_vnni() == (bool(quant._VNNI) and quant._VNNI[0])
        cpu_linear.a8_vnni(False)
        monkeypatch.setattr(quant, "_VNNI", [])
        assert quant.pick_a8_vnni(layers) is False and quant._VNNI == []
    finally:
        cpu_linear.a8_vnni(was)


def test_gguf_option_is_checked(monkeypatch):
    from specserve.config import EngineConfig
    from specserve.server.cli import add_serve_args, engine_config_from_args

    with pytest.raises(ValueError, match="CPU only"):
        quant.check_target_quantization("gguf", "cuda")
    with pytest.raises(ValueError, match="float32"):
        EngineConfig.create(quantization="gguf", dtype="bfloat16", device="cpu")
    args = add_serve_args(argparse.ArgumentParser()).parse_args(["--quantization", "gguf"])
    assert engine_config_from_args(args).model.quantization == "gguf"
    monkeypatch.setattr(cpu_linear._a8_kernel, "_loaded", None)
    monkeypatch.setattr(cpu_linear._a8_kernel, "_error", "gcc failed")
    with pytest.raises(ValueError, match="cannot run here .gcc failed"):
        EngineConfig.create(quantization="gguf", device="cpu")


def test_gguf_target_keeps_speculation_lossless(tmp_path):
    """A tiny target (random float32 weights, so Q8_0 blocks) with int8 activations: plain,
    prompt lookup and EAGLE give the same greedy tokens."""
    from test_eagle_medusa import greedy_ids, tiny_llm, write_eagle1

    plain = tiny_llm(tmp_path, dtype="float32", quantization="gguf")
    model = plain.engine.runner.model
    assert isinstance(model.layers[0].mlp.down_proj.packed, cpu_linear.PackedA8)
    assert isinstance(model.lm_head_kernel, cpu_linear.PackedA8) and model.lm_head.weight.numel() > 0
    want = greedy_ids(plain)
    head = str(write_eagle1(tmp_path / "head"))
    for config in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                   {"method": "eagle", "model": head, "depth": 3, "topk": 2}):
        llm = tiny_llm(tmp_path, {**config, "adaptive": False}, dtype="float32", quantization="gguf")
        assert greedy_ids(llm) == want, config["method"]
        assert llm.engine.stats.spec_num_drafts > 0


def test_default_model_with_gguf_products_speculates_losslessly():
    """The default model (Q4_1 layers, a Q8_0 LM head) with int8 activations: its blocks as
    they are, and prompt lookup and EAGLE (drafting every step: trees of up to 25 rows, more
    than one of the attention kernel's runs) give plain decoding's tokens, as does plain
    decoding of a prompt alone after a prefix-cache hit (its last rows recomputed in a chunk
    of another length). int8 activations turn a last-bit difference anywhere before a product
    into a different token within a few dozen, so this checks that every row's bits are its
    own (it failed while prefill chunks and large trees went through SDPA)."""
    from specserve import LLM, SamplingParams

    prompts = ["Repeat after me: the quick brown fox jumps over the lazy dog. the quick brown fox",
               "Write a Python function that adds two numbers."]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    outs = {}
    for config in (None, {"method": "ngram", "adaptive": False}, {"method": "eagle", "adaptive": False}):
        llm = LLM(None, speculative_config=config, quantization="gguf", num_blocks=64, max_model_len=256)
        outs[str(config)] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if config is None:
            model = llm.engine.runner.model
            assert {model.layers[0].self_attn.qkv_proj.packed.format, model.lm_head_kernel.format} == {"q4_1", "q8_0"}
            hits = llm.engine.stats.prefix_cache_hit_tokens
            outs["alone, cached"] = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
            assert llm.engine.stats.prefix_cache_hit_tokens > hits
        if config is not None:
            assert llm.engine.stats.spec_num_drafts > 0
    assert len(set(map(str, outs.values()))) == 1, outs
