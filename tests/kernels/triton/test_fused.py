"""A layer's elementwise steps in one launch each (specserve/kernels/triton/fused.py): rotary
embedding of q and k, and SiLU(gate) x up, against the model's own PyTorch forms and their
references, rows alone and in a batch; the model with them (`use_invariant_products`) against
the model without. On CPU under the Triton interpreter (tests/kernels/conftest.py)."""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from specserve.kernels.triton.fused import rotary_ref, rotary_triton, silu_mul_ref, silu_mul_triton

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6}


def _rotary_inputs(T, heads, kv, D, dtype):
    from specserve.model.arch import ModelArch
    from specserve.model.llama import RotaryEmbedding

    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, (heads + 2 * kv) * D, generator=g).to(DEV, dtype)
    arch = ModelArch.from_dict({"hidden_size": heads * D, "num_attention_heads": heads, "num_key_value_heads": kv,
                                  "intermediate_size": 8, "num_hidden_layers": 1, "vocab_size": 8})
    rope = RotaryEmbedding(arch, 512).to(DEV)
    positions = torch.randint(0, 500, (T,), generator=g).to(DEV)
    return qkv, rope.table(positions, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv,D", [(4, 2, 16), (3, 1, 64), (2, 2, 24)], ids=str)
def test_rotary_matches_the_models_and_rows_are_invariant(dtype, heads, kv, D):
    from specserve.model.llama import RotaryEmbedding

    qkv, (cos, sin) = _rotary_inputs(9, heads, kv, D, dtype)
    out = rotary_triton(qkv, cos, sin, heads + kv, D)
    assert out.shape == (9, heads + kv, D) and out.dtype == dtype
    torch.testing.assert_close(out, rotary_ref(qkv, cos, sin, heads + kv, D), rtol=TOL[dtype], atol=TOL[dtype])
    model = torch.cat([RotaryEmbedding.apply(qkv[:, :heads * D].view(9, heads, D), cos, sin),
                       RotaryEmbedding.apply(qkv[:, heads * D:(heads + kv) * D].view(9, kv, D), cos, sin)], 1)
    torch.testing.assert_close(out.float(), model.float(), rtol=4 * TOL[dtype], atol=4 * TOL[dtype])
    assert torch.equal(rotary_triton(qkv[4:6], cos[4:6], sin[4:6], heads + kv, D), out[4:6])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,inter", [(1, 40), (6, 1500)], ids=str)
def test_silu_mul_matches_the_models_and_rows_are_invariant(dtype, T, inter):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(T, 2 * inter, generator=g) * 4).to(DEV, dtype)
    out = silu_mul_triton(x)
    assert out.shape == (T, inter) and out.dtype == dtype
    torch.testing.assert_close(out, silu_mul_ref(x), rtol=TOL[dtype], atol=TOL[dtype])
    gate, up = x.split(inter, dim=-1)
    torch.testing.assert_close(out.float(), (F.silu(gate) * up).float(), rtol=4 * TOL[dtype], atol=4 * TOL[dtype])
    assert torch.equal(silu_mul_triton(x[T - 1:]), out[T - 1:])


def test_the_ops_under_compile(monkeypatch):
    """The registered ops: dispatch (the kernel where forced, else the reference) and a trace by
    torch.compile(fullgraph=True) through their fakes, with a dynamic number of rows."""
    from specserve.model.invariant_ops import add_rms_norm_invariant, rotary_invariant, silu_mul_invariant

    qkv, (cos, sin) = _rotary_inputs(6, 4, 2, 16, torch.float32)
    x = torch.randn(6, 64, device=DEV)
    monkeypatch.setenv("SPECSERVE_KERNELS", "torch")
    assert torch.equal(rotary_invariant(qkv, cos, sin, 6, 16), rotary_ref(qkv, cos, sin, 6, 16))
    assert torch.equal(silu_mul_invariant(x), silu_mul_ref(x))
    monkeypatch.setenv("SPECSERVE_KERNELS", "triton")
    eager = (rotary_invariant(qkv, cos, sin, 6, 16), silu_mul_invariant(x),
             add_rms_norm_invariant(x, x, torch.ones(64, device=DEV), 1e-6))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, c, s, x: (rotary_invariant(q, c, s, 6, 16), silu_mul_invariant(x),
                                                 add_rms_norm_invariant(x, x, torch.ones(64, device=x.device), 1e-6)),
                             fullgraph=True, dynamic=True)
    got = compiled(qkv, cos, sin, x)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], eager[2]))
    got = compiled(qkv[:3], cos[:3], sin[:3], x[:3])
    assert torch.equal(got[0], eager[0][:3]) and torch.equal(got[1], eager[1][:3])


def test_a_model_with_them_stays_the_model(tmp_path, default_model_dir):
    """A tiny model's logits with every invariant op (the references on a CPU) against the same
    model without them: within a few bfloat16 roundings."""
    from specserve import LLM, SamplingParams
    from tests.conftest import write_tiny_model

    model = write_tiny_model(tmp_path / "m", default_model_dir, vocab_size=256, hidden=64)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    prompt = {"prompt_token_ids": [5, 9, 17, 33, 5, 9, 17, 33, 5, 9]}
    out = []
    for invariant in (False, True):
        llm = LLM(str(model), dtype="bfloat16", num_blocks=16, max_model_len=64, speculative_config=None)
        if invariant:
            llm.engine.runner.model.use_invariant_products()
        out.append(llm.generate(prompt, params)[0].outputs[0])
    assert out[0].token_ids == out[1].token_ids
    top = dict(out[0].logprobs[0].top)
    assert [t for t, _ in out[1].logprobs[0].top][:2] == list(top)[:2]
    assert all(abs(top[t] - lp) < 0.1 for t, lp in out[1].logprobs[0].top if t in top)
