"""Our CPU linear layers (specserve.kernels.cpu.cpu_linear): weight-only int8 (specserve.model.quant),
float32, and float32 weights that are exactly GGUF Q4_1/Q8_0 blocks; draft-head formats
(specserve.spec_decode.quant)."""

import argparse

import pytest
import torch
from torch import nn

from specserve.config import SpecConfig
from specserve.model.arch import ModelArch
from specserve.spec_decode.eagle_head import DraftPass, EagleHead, HeadKV, Segment
from specserve.spec_decode.medusa_heads import MedusaHeads
from specserve.kernels.cpu import cpu_linear
from specserve.model import quant
from specserve.model.quant import Int8Linear, check_target_quantization, int8_rows, quantize_linears, quantize_rows
from specserve.spec_decode.quant import A8, INT8_ALWAYS, check_quantization, draft_linear


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_rows_round_trip_within_half_a_step():
    w = torch.randn(48, 80) * torch.linspace(0.01, 3, 48)[:, None]  # rows of very different sizes
    q, scales = quantize_rows(w)
    assert q.dtype == torch.int8 and scales.shape == (48,)
    assert int(q.abs().amax(1).min()) == 127  # every row uses its whole range
    assert torch.all((q.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-6)


needs_kernel = pytest.mark.skipif(not cpu_linear.available(),
                                  reason=f"the int8 CPU kernel cannot run here ({cpu_linear.why_unavailable()})")


@pytest.fixture(params=["own kernel", "torch"])
def path(request, monkeypatch):
    """Int8Linear through our kernel, and through torch's (what a machine without it gets)."""
    if request.param == "own kernel" and not cpu_linear.available():
        pytest.skip(f"the int8 CPU kernel cannot run here ({cpu_linear.why_unavailable()})")
    if request.param == "torch":
        monkeypatch.setattr(cpu_linear, "available", lambda: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, Int8Linear.MAX_ROWS, Int8Linear.MAX_ROWS + 1, 19])
def test_int8_linear_tracks_the_full_precision_layer(path, dtype, rows):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160).to(dtype)
    q = Int8Linear.from_linear(lin)
    assert q.own_kernel == (path == "own kernel")
    x = torch.randn(rows, 96, dtype=dtype)
    y = q(x)
    assert y.dtype == dtype and rel_err(y, lin(x)) < 0.02
    qw, scales = quantize_rows(lin.weight)
    deq = nn.functional.linear(x.double(), qw.double() * scales.double()[:, None], lin.bias.double())
    assert rel_err(y, deq) < (0.01 if dtype == torch.bfloat16 else 1e-5)  # the quantized layer, up to rounding
    if path == "torch" and rows <= Int8Linear.MAX_ROWS:  # few rows go through torch's int8 kernel
        assert torch.equal(y, torch._weight_int8pack_mm(x, q.qweight, q.scales) + q.bias)
    assert q(x[None]).shape == (1, rows, 160)


@needs_kernel
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (100, 37), (8, 8), (65, 3)])
def test_own_kernel_rows_do_not_depend_on_the_batch(shape):
    """A row's output has the same bits in any batch, at any position, with any thread count,
    from a strided input: what keeps speculation over an int8 target exactly lossless."""
    torch.manual_seed(0)
    n, k = shape
    lin = Int8Linear(torch.randn(n, k) * torch.rand(n, 1), torch.randn(n))
    wide = torch.randn(23, k + 5) * torch.rand(23, 1) * 3
    x = wide[:, 2:2 + k]  # rows with a stride
    full = lin(x)
    ref = nn.functional.linear(x.double(), _dequant(lin).double(), lin.kernel.bias.double())
    assert (full.double() - ref).abs().max() <= 1e-4 * ref.abs().max()
    for m in (1, 2, 3, 5, 6, 7, 12, 13):
        for start in (0, 4, 23 - m):
            assert torch.equal(lin(x[start:start + m]), full[start:start + m]), (m, start)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lin(x), full)
    finally:
        torch.set_num_threads(threads)
    assert lin(x[:0]).shape == (0, n)
    with pytest.raises(ValueError, match=f"expected {k}"):  # never a read past the weights
        lin(torch.randn(2, k + 1))


def _dequant(lin: Int8Linear) -> torch.Tensor:
    """The layer's weights as the kernel reads them, back from its strips of 8 columns
    (k-major inside a strip; N padded to a multiple of 64)."""
    n = lin.out_features
    packed = lin.kernel.packed
    k = packed.numel() // (-(-n // 64) * 64)
    q = packed.view(-1, k, 8).permute(0, 2, 1).reshape(-1, k)[:n]
    return q.float() * lin.kernel.scales[:, None]


def test_int8_heads_track_the_float_ones():
    """EAGLE drafts through DraftPass with int8 products (draft_linear); Medusa's heads have
    every nn.Linear replaced in place (quantize_linears)."""
    arch = ModelArch.from_dict({"hidden_size": 64, "intermediate_size": 128, "vocab_size": 96,
                                "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2})
    eagle, medusa = EagleHead(arch), MedusaHeads(3, 1, 64, vocab=96)
    x = torch.randn(2, 64)
    int8 = DraftPass(eagle, lambda w, b: draft_linear(w, b, INT8_ALWAYS, False))
    assert isinstance(int8.qkv, Int8Linear)
    with torch.no_grad():
        want = eagle(x[None], x[None], torch.arange(2))[0][0]
    assert rel_err(int8(x, x, torch.arange(2), [Segment(HeadKV(), 0, 2, None)]), want) < 0.02
    quantize_linears(medusa)
    assert not any(type(m) is nn.Linear for m in medusa.modules())
    assert any(isinstance(m, Int8Linear) for m in medusa.modules())
    assert medusa.logits(x, None).shape == (3, 2, 96)


@pytest.mark.parametrize("bias", [False, True])
def test_float32_draft_products_through_torch_read_the_weight_transposed(bias):
    """A float32 draft product on torch's GEMM (not int8, not our kernel) keeps a [K, N] copy
    of its weight (MKL's faster layout for a few rows) and computes the layer's product."""
    w = torch.randn(48, 80)
    b = torch.randn(48) if bias else None
    product = draft_linear(w, b, 0, False)
    weight_t = next(c.cell_contents for c in product.__closure__ if isinstance(c.cell_contents, torch.Tensor)
                    and c.cell_contents.shape == (80, 48))
    assert weight_t.is_contiguous()
    for rows in (1, 3, 8, 17):
        x = torch.randn(rows, 80)
        torch.testing.assert_close(product(x), nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_a_draft_product_runs_int8_up_to_its_row_limit(bias):
    """draft_linear with a row limit: int8 (Int8Linear's exact result) up to it, the model's
    dtype (the float product's exact result) past it; 0 never int8, INT8_ALWAYS always."""
    w = torch.randn(48, 80)
    b = torch.randn(48) if bias else None
    int8, dense = Int8Linear(w, b), draft_linear(w, b, 0, False)
    product = draft_linear(w, b, 4, False)
    for rows in (1, 4, 5, 17):
        x = torch.randn(rows, 80)
        assert torch.equal(product(x), (int8 if rows <= 4 else dense)(x))
        assert not torch.equal(int8(x), dense(x))  # (the two differ: the test can tell them apart)
    assert isinstance(draft_linear(w, b, INT8_ALWAYS, False), Int8Linear)


def test_int8_rows_reads_the_measurement(monkeypatch):
    """int8_rows: none unless int8 wins at 1 and 4 rows; then as far as it keeps winning."""
    times = {}  # rows -> (int8, float) seconds a call, as a fake timing

    def faster(ours, theirs, hidden, dtype, rows_list=(1, 4), margin=0.9, rounds=20):
        return all(times[r][0] <= margin * times[r][1] for r in rows_list)

    monkeypatch.setattr(quant, "_faster", faster)
    monkeypatch.setattr(quant, "_streamed", lambda h, i, d: [torch.randn(i, h, dtype=d)])
    for case, want in [({1: (1, 2), 4: (1, 2), 8: (1, 2), 16: (2, 1), 32: (1, 2), 64: (1, 2)}, 8),
                       ({1: (1, 2), 4: (1.95, 2), 8: (1, 2), 16: (1, 2), 32: (1, 2), 64: (1, 2)}, 0),
                       ({r: (1, 2) for r in (1, 4, 8, 16, 32, 64)}, 64)]:
        times.clear()
        times.update(case)
        monkeypatch.setattr(quant, "_INT8_ROWS", {})
        assert int8_rows(16, 32, torch.float32) == want


def test_quantization_option_is_checked():
    cpu, gpu, shape = torch.device("cpu"), torch.device("cuda"), (64, 128, torch.float32)
    # auto: measured on a CPU against the products the head would otherwise run (whichever way
    # it goes here), never on a GPU
    assert check_quantization(None, cpu, *shape) == check_quantization("auto", cpu, *shape) in (
        A8, 0, 4, *quant.INT8_ROWS)
    assert not check_quantization(None, gpu, *shape)
    assert check_quantization("int8", cpu, *shape) == INT8_ALWAYS and check_quantization("none", cpu, *shape) == 0
    with pytest.raises(ValueError, match="expected one of auto, gguf, int8, none"):
        SpecConfig(method="eagle", extra={"quantization": "fp8"})
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization("int8", gpu, *shape)
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization("gguf", gpu, *shape)
    with pytest.raises(ValueError, match="multiples of 32"):
        check_quantization("gguf", cpu, 64, 100, torch.float32)
    with pytest.raises(ValueError, match="float32"):
        check_quantization("gguf", cpu, 64, 128, torch.bfloat16)


@pytest.mark.skipif(not cpu_linear.a8_available(), reason="the int8-activation kernel cannot run here")
def test_a_gguf_head_drafts_with_int8_activations_close_to_the_float_head():
    """quantization "gguf": every product of an EAGLE pass (and its LM head) through pack_a8's
    kernel, close to the float32 head's; an engine drafting so stays plain decoding's output."""
    arch = ModelArch.from_dict({"hidden_size": 64, "intermediate_size": 128, "vocab_size": 96,
                                "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2})
    eagle = EagleHead(arch)
    x = torch.randn(2, 64)
    a8 = DraftPass(eagle, lambda w, b: draft_linear(w, b, A8, False))
    assert isinstance(a8.qkv, cpu_linear.PackedA8) and isinstance(a8.fc, cpu_linear.PackedA8)
    with torch.no_grad():
        want = eagle(x[None], x[None], torch.arange(2))[0][0]
    assert rel_err(a8(x, x, torch.arange(2), [Segment(HeadKV(), 0, 2, None)]), want) < 0.03
    assert check_quantization("gguf", torch.device("cpu"), 64, 128, torch.float32) == A8
    odd = torch.randn(8, 40)  # a reduction of 40: not whole blocks of 32, so the float product
    assert torch.equal(draft_linear(odd, None, A8, False)(x[:, :40]), draft_linear(odd, None, 0, False)(x[:, :40]))


def test_a_gguf_draft_head_keeps_eagle_lossless(llm, make_llm):
    """The default model's EAGLE head with int8-activation products (each pass one C call
    where it can be): greedy output equal to plain decoding's, token for token."""
    from specserve import SamplingParams

    if not cpu_linear.a8_available():
        pytest.skip("the int8-activation kernel cannot run here")
    spec = make_llm(max_model_len=2048, speculative_config={"method": "eagle", "quantization": "gguf",
                                                            "adaptive": False})
    draft = spec.engine.spec.proposer.draft
    assert all(isinstance(p, cpu_linear.PackedA8) for p in (draft.fc, draft.qkv, draft.gate_up, draft.down))
    params = SamplingParams(temperature=0, max_tokens=48)
    prompts = ["Write a short poem about the sea.", "def fibonacci(n):"]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    got = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == want
    assert spec.engine.stats.spec_num_drafts > 0


@needs_kernel
def test_f32_kernel_tracks_linear_and_gives_every_row_the_same_bits():
    torch.manual_seed(0)
    lin = nn.Linear(200, 77)  # 77: a last, partial strip of columns
    packed = cpu_linear.PackedFloat32(lin.weight, lin.bias)
    x = torch.randn(19, 200)
    y = packed(x)
    torch.testing.assert_close(y, lin(x), atol=1e-5, rtol=1e-5)
    for rows in (slice(0, 1), slice(5, 7), slice(7, 11), slice(11, 17)):  # every tile shape
        assert torch.equal(packed(x[rows]), y[rows])
    assert packed(x[None]).shape == (1, 19, 77)


def gguf_like(fmt: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, k] float32 weights as GGUF's dequantization makes them: per block of 32 along k,
    d * q + m (Q4_1, q in 0..15) or d * q (Q8_0, q in -127..127), d and m float16."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    if fmt == "q4_1":
        m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
        q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15  # as a quantizer does: the block's extremes
        return (d[..., None] * q + m[..., None]).reshape(n, k)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127
    return (d[..., None] * q).reshape(n, k)


@pytest.fixture(params=["avx2", "avx512"])
def blocks_isa(request):
    """The block formats (direct tiles and chunk path) with AVX2, then with AVX-512 (where the
    CPU has AVX-512F); the kernel's own choice restored after."""
    was = cpu_linear.wide()
    if not cpu_linear.wide(request.param == "avx512") and request.param == "avx512":
        cpu_linear.wide(was)
        pytest.skip("no AVX-512F on this CPU")
    yield request.param
    cpu_linear.wide(was)


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_gguf_blocks_give_the_float32_products_bit_for_bit(fmt, blocks_isa):
    w = gguf_like(fmt, 77, 288)  # 77: a last, partial strip of columns; 288: chunks of k of 128, 128, 32
    bias = torch.randn(77)
    packed, dense = cpu_linear.pack_float32(w, bias), cpu_linear.PackedFloat32(w, bias)
    assert packed.format == fmt and packed.packed.numel() < 2 * w.numel()  # bytes: under half of float32, padded
    x = torch.randn(40, 288)
    most = cpu_linear.direct_rows()  # straight from the blocks up to 12 rows (AVX2) or 28 (AVX-512)
    assert most == (28 if blocks_isa == "avx512" else 12)
    try:
        for m in range(1, 41):  # every tile shape and grouping of rows, then the rebuilt chunks
            want = dense(x[:m]).view(torch.int32)
            assert torch.equal(packed(x[:m]).view(torch.int32), want), m
            cpu_linear.direct_rows(4)  # the chunk path from 5 rows on: the same bits
            assert torch.equal(packed(x[:m]).view(torch.int32), want), m
            cpu_linear.direct_rows(0)
    finally:
        cpu_linear.direct_rows(0)
    assert cpu_linear.direct_rows() == most
    torch.testing.assert_close(packed(x), x @ w.T + bias, atol=1e-4, rtol=1e-4)
    assert torch.equal(packed(x[5:6]).view(torch.int32), packed(x)[5:6].view(torch.int32))  # batch-invariant
    no_bias = cpu_linear.pack_float32(w[:64].contiguous(), None)  # whole blocks of columns, no bias
    rows = torch.cat([no_bias(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(no_bias(x).view(torch.int32), rows.view(torch.int32))


@needs_kernel
def test_the_blocks_isa_is_measured_and_set(monkeypatch):
    """pick_wide_blocks times AVX-512 against AVX2 on the layers it is given (where the CPU has
    AVX-512F) and leaves the kernel on the faster one; kept to AVX2, it measures nothing."""
    import specserve.model.quant as quant

    layers = [cpu_linear.pack_float32(gguf_like("q4_1", 192, 128, seed), None) for seed in range(2)]
    was = cpu_linear.wide()
    try:
        monkeypatch.setattr(quant, "_WIDE", [])
        assert quant.pick_wide_blocks(layers) == cpu_linear.wide() == (bool(quant._WIDE) and quant._WIDE[0])
        cpu_linear.wide(False)
        monkeypatch.setattr(quant, "_WIDE", [])
        assert quant.pick_wide_blocks(layers) is False and quant._WIDE == []
    finally:
        cpu_linear.wide(was)


@needs_kernel
def test_weights_that_are_not_exact_blocks_stay_float32():
    w = gguf_like("q4_1", 64, 64)
    w[5, 7] = torch.nextafter(w[5, 7], torch.tensor(1.0))  # one weight off by one unit in the last place
    assert cpu_linear.pack_blocks(w) is None and cpu_linear.pack_float32(w, None).format == "f32"
    assert cpu_linear.pack_blocks(torch.randn(64, 64)) is None
    assert cpu_linear.pack_blocks(torch.randn(64, 40)) is None  # k not whole blocks
    assert cpu_linear.pack_blocks(gguf_like("q8_0", 64, 64).half()) is None  # float32 only


@needs_kernel
def test_default_model_reads_its_gguf_blocks_and_decodes_as_float32(monkeypatch):
    """The default model (a Q4_1 GGUF, embedding/LM head Q8_0) in float32: every projection in
    Q4_1 blocks, the LM head in Q8_0, and greedy tokens with their logprobs exactly those of
    the float32 weights through the same kernel."""
    from specserve import LLM, SamplingParams

    prompts = ["Explain how a hash table works.", "def quicksort(arr):"]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1)

    def run():
        llm = LLM(max_model_len=256, num_blocks=64, dtype="float32", speculative_config=None)
        model = llm.engine.runner.model
        formats = {model.layers[0].self_attn.qkv_proj.packed.format, model.layers[0].mlp.down_proj.packed.format,
                   model.lm_head_kernel.format}
        outs = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
                for o in llm.generate(prompts, params)]
        return formats, outs

    formats, blocks = run()
    assert formats == {"q4_1", "q8_0"}
    monkeypatch.setattr(cpu_linear, "pack_float32", lambda w, b: cpu_linear.PackedFloat32(w, b))
    monkeypatch.setattr(cpu_linear, "pack_blocks", lambda w: None)
    formats, dense = run()
    assert formats == {"f32"} and blocks == dense


@needs_kernel
def test_f32_kernel_target_keeps_speculation_lossless(tmp_path, monkeypatch):
    """A float32 target's layers go into our kernel even where torch's GEMM measures faster
    (torch's rows are not batch-invariant, docs/cpu.md): plain, prompt lookup and EAGLE give
    the same greedy tokens."""
    from test_eagle_medusa import greedy_ids, tiny_llm, write_eagle1

    import specserve.model.quant as quant

    monkeypatch.setattr(quant, "f32_kernel_pays", lambda hidden, intermediate: False)
    plain = tiny_llm(tmp_path, dtype="float32")  # "auto" is bfloat16 on a CPU with native bfloat16
    model = plain.engine.runner.model
    assert model.layers[0].mlp.down_proj.packed is not None and model.layers[0].mlp.down_proj.weight.numel() == 0
    assert isinstance(model.lm_head_kernel, cpu_linear.PackedFloat32) and model.lm_head.weight.numel() > 0
    want = greedy_ids(plain)
    head = str(write_eagle1(tmp_path / "head"))
    for config in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                   {"method": "eagle", "model": head, "depth": 3, "topk": 2}):
        llm = tiny_llm(tmp_path, {**config, "adaptive": False}, dtype="float32")  # drafts every step
        assert greedy_ids(llm) == want, config["method"]
        assert llm.engine.stats.spec_num_drafts > 0


def test_target_quantization_option_is_checked(monkeypatch):
    from specserve.config import EngineConfig
    from specserve.server.cli import add_serve_args, engine_config_from_args

    with pytest.raises(ValueError, match="expected one of none, int8"):
        EngineConfig.create(quantization="int4")
    with pytest.raises(ValueError, match="CPU only"):
        check_target_quantization("int8", "cuda")
    assert EngineConfig.create().model.quantization == "none"
    if cpu_linear.available():
        args = add_serve_args(argparse.ArgumentParser()).parse_args(["--quantization", "int8"])
        assert engine_config_from_args(args).model.quantization == "int8"
    monkeypatch.setattr(cpu_linear._kernel, "_loaded", None)
    monkeypatch.setattr(cpu_linear._kernel, "_error", "this CPU lacks AVX2/FMA")
    with pytest.raises(ValueError, match="cannot run here .this CPU lacks AVX2/FMA"):
        EngineConfig.create(quantization="int8", device="cpu")


@needs_kernel
def test_int8_target_keeps_speculation_lossless(tmp_path):
    """Greedy output of a tiny int8 target: plain, prompt lookup and EAGLE token for token equal."""
    from test_eagle_medusa import greedy_ids, tiny_llm, write_eagle1

    plain = tiny_llm(tmp_path, quantization="int8")
    model = plain.engine.runner.model
    assert isinstance(model.layers[0].mlp.down_proj, Int8Linear) and isinstance(model.lm_head_kernel, Int8Linear)
    want = greedy_ids(plain)
    head = str(write_eagle1(tmp_path / "head"))
    for config in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                   {"method": "eagle", "model": head, "depth": 3, "topk": 2}):
        llm = tiny_llm(tmp_path, {**config, "adaptive": False}, quantization="int8")  # drafts every step
        assert greedy_ids(llm) == want, config["method"]
        assert llm.engine.stats.spec_num_drafts > 0


@needs_kernel
def test_int8_default_model_speculates_losslessly():
    """The default model with int8 weights: prompt lookup gives plain decoding's tokens."""
    from specserve import LLM, SamplingParams

    prompts = ["Repeat after me: the quick brown fox jumps over the lazy dog. the quick brown fox",
               "Write a Python function that adds two numbers."]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outs = {}
    for config in (None, {"method": "ngram"}):
        llm = LLM(None, speculative_config=config, quantization="int8", num_blocks=64)
        outs[str(config)] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["None"] == outs[str({"method": "ngram"})]


def test_auto_dtype_is_float32_where_our_kernels_run(monkeypatch):
    """dtype "auto" on a CPU: float32 wherever our C kernels run (they beat oneDNN's bfloat16
    on the AVX512-BF16 machine bfloat16 had been chosen for), bfloat16 on a native-bfloat16
    CPU without them, float32 elsewhere; explicit dtypes are kept."""
    import specserve.model.runner as runner

    cpu = torch.device("cpu")
    assert runner.pick_dtype("bfloat16", cpu) == torch.bfloat16
    for kernels, native, want in ((True, True, torch.float32), (True, False, torch.float32),
                                  (False, True, torch.bfloat16), (False, False, torch.float32)):
        monkeypatch.setattr(cpu_linear, "available", lambda kernels=kernels: kernels)
        monkeypatch.setattr(runner, "cpu_has_native_bf16", lambda native=native: native)
        assert runner.pick_dtype("auto", cpu) == want, (kernels, native)
