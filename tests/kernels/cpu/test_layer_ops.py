"""A layer's small ops in C (specserve/kernels/cpu/layer_ops.c): the rotary embedding gives
PyTorch's bits, the RMS norm with its residual add matches PyTorch's and gives every row the
same bits whatever the batch, the MLP activation matches PyTorch's, the vocabulary argmax is
torch.argmax's answer (ties and NaN included), and the model that uses them decodes as the one
that does not."""

import pytest
import torch
import torch.nn.functional as F

from specserve.kernels.cpu import layer_ops
from specserve.model.llama import MLP, Attention, RMSNorm, RotaryEmbedding

pytestmark = pytest.mark.skipif(not layer_ops.available(), reason="layer_ops kernel unavailable")


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 36)])  # 36: half a head is no multiple of 8
def test_rotary_in_place_is_torch_bits(rows, shape):
    hq, hkv, d = shape
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g)
    cos, sin = torch.randn(rows, 1, d // 2, generator=g), torch.randn(rows, 1, d // 2, generator=g)
    q = qkv[:, :hq * d].reshape(rows, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].reshape(rows, hkv, d)
    want_q, want_k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
    got = qkv.clone()
    layer_ops.rotary_(got, hq + hkv, d, cos, sin)
    assert torch.equal(got[:, :hq * d].reshape(rows, hq, d), want_q)
    assert torch.equal(got[:, hq * d:(hq + hkv) * d].reshape(rows, hkv, d), want_k)
    assert torch.equal(got[:, (hq + hkv) * d:], qkv[:, (hq + hkv) * d:])  # v untouched


@pytest.mark.parametrize("shape", [(1, 49152), (17, 512), (70, 4099), (3, 5)])
def test_argmax_is_torch_argmax(shape):
    rows, n = shape
    g = torch.Generator().manual_seed(n)
    x = torch.randn(rows, n + 3, generator=g)[:, 1:n + 1]  # a row stride past the row
    assert torch.equal(layer_ops.argmax(x), x.argmax(-1))
    x[:, ::3] = x.max()  # ties: the first
    assert torch.equal(layer_ops.argmax(x), x.argmax(-1))
    x[:, :] = -torch.inf
    x[0, n - 1] = 1.0
    assert torch.equal(layer_ops.argmax(x), x.argmax(-1))
    x = torch.randn(rows, n, generator=g)
    x[0, n // 2], x[0, n - 1], x[-1, 0] = torch.nan, torch.nan, torch.nan  # the first NaN
    x[rows // 2, n - 1] = torch.inf
    assert torch.equal(layer_ops.argmax(x), x.argmax(-1))


@pytest.mark.parametrize("shape,k", [((1, 8192), 2), ((6, 515), 4), ((3, 9), 9)])
def test_top_logprobs_is_log_softmax_topk(shape, k):
    g = torch.Generator().manual_seed(k)
    x = 4 * torch.randn(shape[0], shape[1] + 2, generator=g)[:, 2:]
    val, idx = layer_ops.top_logprobs(x, k)
    want_val, want_idx = x.log_softmax(-1).topk(k, -1)
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(val, want_val, atol=2e-6, rtol=1e-6)
    d2t = torch.randperm(3 * shape[1], generator=g)[:shape[1]]  # a draft vocabulary's ids in the target's
    mapped_val, mapped_idx = layer_ops.top_logprobs(x, k, d2t)
    assert torch.equal(mapped_idx, d2t[want_idx]) and torch.equal(mapped_val, val)
    x[0, :] = -torch.inf  # a masked row: its allowed columns first, then the lowest masked ones
    x[0, shape[1] - 1] = 0.0
    val, idx = layer_ops.top_logprobs(x, k)
    assert idx[0].tolist() == [shape[1] - 1] + list(range(k - 1))
    assert val[0, 0] == 0.0 and (val[0, 1:] == -torch.inf).all()


def test_rows_view_says_what_the_kernels_can_read_and_draft_top_k_hands_them_over():
    from specserve.sampling.sampler import draft_top_k, host_copy

    g = torch.Generator().manual_seed(3)
    x = (4 * torch.randn(5, 300, generator=g))[:, 7:290]  # a row stride past the row
    ptr, rows, n, stride = layer_ops.rows_view(x)
    assert (ptr, rows, n, stride) == (x.data_ptr(), 5, 283, 300)
    for other in (x.double(), x.t(), x[None], x.bfloat16()):
        assert layer_ops.rows_view(other) is None
    assert draft_top_k(x, 3)[:2] == (layer_ops.rows_view(x), 0)  # the C reads the logits
    d2t = torch.randperm(1000, generator=g)[:283]
    view, ids, (val, idx) = draft_top_k(x.double(), 3, d2t)  # another dtype: PyTorch's top-k, handed over
    want_val, want_idx = layer_ops.top_logprobs(x, 3, d2t)
    assert view == layer_ops.rows_view(val) and ids == idx.data_ptr() and idx.is_contiguous()
    assert torch.equal(idx, want_idx) and torch.equal(val, want_val)
    val[0, 0] = -torch.inf  # off the CPU the ids and the values' bits come over as one tensor
    lp, tok = host_copy(val.t().contiguous().t(), idx)
    assert torch.equal(tok, idx) and torch.equal(lp, val) and lp.is_contiguous() and tok.is_contiguous()


def test_greedy_verification_takes_the_walk(monkeypatch):
    from specserve.sampling import FlatTrees, verify_trees

    calls, real = [], layer_ops.greedy_walk
    monkeypatch.setattr(layer_ops, "greedy_walk", lambda *a: calls.append(a[1]) or real(*a))
    x = torch.zeros(1 + 3 + 1, 6)  # request 0: root and a 3-node tree; request 1: its root alone
    x[0, 4] = x[1, 2] = x[3, 5] = x[4, 1] = 1.0  # 4 at the root, then 2 under node 0
    trees = FlatTrees([0, 4], [([4, 3, 2], [-1, -1, 0], None), ([], [], None)], 6, "cpu")
    verdict = verify_trees(x, None, None, None, trees, True)
    assert (verdict.accepted, verdict.final) == ([[0, 2], []], [5, 1])
    assert calls == [[0, 4]]
    with pytest.raises(IndexError):  # a tree whose rows are not all in x
        layer_ops.greedy_walk(layer_ops.rows_view(x), [2], [([4, 3, 2], [-1, -1, 0])])


def test_the_host_calls_check_their_lists_and_verification_runs_without_them(monkeypatch, tmp_path):
    from specserve.kernels.cpu.cbuild import Extension
    from specserve.sampling import FlatTrees, verify_trees

    assert layer_ops.host_available()
    x = torch.zeros(1 + 3 + 1, 6)
    x[0, 4] = x[1, 2] = x[3, 5] = x[4, 1] = 1.0
    view = layer_ops.rows_view(x)
    for roots, trees, error in (([0], [([4, "a"], [-1, -1])], TypeError), ([0, 4], [([4], [-1])], ValueError),
                                ([0], [([4, 3], [-1])], ValueError), ([0], [[4, 3]], TypeError)):
        with pytest.raises(error):
            layer_ops.greedy_walk(view, roots, trees)
    trees = FlatTrees([0, 4], [([4, 3, 2], [-1, -1, 0], None), ([], [], None)], 6, "cpu")
    want = verify_trees(x, None, None, None, trees, True)
    monkeypatch.setattr(layer_ops, "host_available", lambda: False)  # no Python headers: PyTorch's argmax
    got = verify_trees(x, torch.tensor([True, True]), torch.tensor([0, 0]), torch.zeros(5, dtype=torch.int64),
                       trees, True)
    assert (got.accepted, got.final) == (want.accepted, want.final) == ([[0, 2], []], [5, 1])
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C")
    ext = Extension(broken)
    assert ext.module is None and "failed" in ext.why_unavailable()


def test_row_argmax_takes_the_kernel(monkeypatch):
    from specserve.sampling import row_argmax

    calls, real = [], layer_ops.argmax
    monkeypatch.setattr(layer_ops, "argmax", lambda x: calls.append(x.shape) or real(x))
    x = torch.randn(4, 49152)
    assert torch.equal(row_argmax(x), x.argmax(-1))
    assert torch.equal(row_argmax(x.double()), x.double().argmax(-1))  # not float32: PyTorch's
    assert calls == [(4, 49152)]


@pytest.mark.parametrize("dim", [576, 100])
def test_rms_norm_with_residual(dim):
    g = torch.Generator().manual_seed(dim)
    x, res = torch.randn(40, dim, generator=g), torch.randn(40, dim, generator=g)
    w = torch.randn(dim, generator=g)
    out, total = layer_ops.rms_norm(x, w, 1e-5, res)
    assert torch.equal(total, x + res)  # the same additions
    torch.testing.assert_close(out, F.rms_norm(x + res, (dim,), w, 1e-5), atol=2e-6, rtol=2e-6)
    alone, same = layer_ops.rms_norm(x, w, 1e-5)
    assert same is x or torch.equal(same, x)
    torch.testing.assert_close(alone, F.rms_norm(x, (dim,), w, 1e-5), atol=2e-6, rtol=2e-6)
    for lo, hi in [(0, 1), (7, 8), (3, 19)]:  # a row's bits do not depend on the rows around it
        assert torch.equal(layer_ops.rms_norm(x[lo:hi], w, 1e-5, res[lo:hi])[0], out[lo:hi])


@pytest.mark.parametrize("rows,inter", [(1, 1536), (5, 36), (80, 520)])
def test_silu_mul_is_torch_to_float_precision(rows, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = 6 * torch.randn(rows, 2 * inter, generator=g)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # the range ends and zero
    gate, up = gate_up.split(inter, -1)
    got = layer_ops.silu_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-6, rtol=2e-6)
    assert torch.equal(layer_ops.silu_mul(gate_up[-1:].contiguous()), got[-1:])  # a row alone: the same bits


def test_model_uses_them_on_cpu_float32(make_llm, tiny_model_dir, monkeypatch):
    from specserve import SamplingParams

    calls = {"rms_norm": 0, "rotary_": 0, "silu_mul": 0}
    for name in calls:
        def counted(*args, _fn=getattr(layer_ops, name), _name=name):
            calls[_name] += 1
            return _fn(*args)
        monkeypatch.setattr(layer_ops, name, counted)
    llm = make_llm(str(tiny_model_dir), dtype="float32", load_format="dummy", seed=0, speculative_config=None)
    model = llm.engine.runner.model
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.fused for m in norms)
    assert all(m.fused_rotary for m in model.modules() if isinstance(m, Attention))
    assert all(m.fused for m in model.modules() if isinstance(m, MLP))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    in_c = [o.outputs[0].token_ids for o in llm.generate(["a b c", "hello there"], params)]
    assert model.decoder is not None and calls == dict.fromkeys(calls, 0)  # every layer in one C call
    model.decoder = None  # the layer-by-layer path: these kernels called one by one
    fused = [o.outputs[0].token_ids for o in llm.generate(["a b c", "hello there"], params)]
    layers = len(model.layers)
    assert calls["rms_norm"] >= 2 * layers + 1 and calls["rotary_"] >= layers  # per forward at least
    assert calls["silu_mul"] >= layers
    model.use_layer_ops(False)
    before = dict(calls)
    plain = [o.outputs[0].token_ids for o in llm.generate(["a b c", "hello there"], params)]
    assert calls == before  # PyTorch ops only
    assert fused == plain == in_c
