"""The batch-invariant linear (specserve/kernels/triton/matmul.py, the op in model/invariant_ops.py):
agreement with F.linear and the reference, several K partitions with ragged tails, both launch
modes giving the same bits, and the invariance itself: a row's bits alone, in a batch, in a
permuted batch and in a sub-batch.

On CPU the kernels run under the Triton interpreter (tests/kernels/conftest.py), with small shapes;
one test runs real shapes on a GPU only; the last ones run a model's products through the op inside
the engine (`--batch-invariant`).
"""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from specserve import SamplingParams
from specserve.kernels.triton import matmul as mm
from specserve.kernels.triton.matmul import linear_invariant_ref, linear_invariant_triton

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# relative to the largest output: float32 products are exact-ish ("ieee"), bfloat16 rounds once
TOL = {torch.float32: 1e-4, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -9}


def _inputs(M, N, K, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV, dtype)
    b = torch.randn(N, generator=g).to(DEV, dtype) if bias else None
    return x, w, b


def _close(y, ref, dtype):
    scale = ref.abs().max().item()
    torch.testing.assert_close(y.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype] * scale)


def _both_modes(x, w, b, split_k):
    """The split and the fused launch; they must agree bit for bit."""
    split = linear_invariant_triton(x, w, b, split_k=split_k, split=True)
    fused = linear_invariant_triton(x, w, b, split_k=split_k, split=False)
    assert split.dtype == x.dtype and split.shape == (x.shape[0], w.shape[0])
    assert torch.equal(split, fused), "split and fused launches differ"
    return split


# (M, N, K, split_k): one row, a few, rows across a BLOCK_M boundary; K never a multiple of BLOCK_K,
# 3 to 5 partitions with a ragged last one; N never a multiple of BLOCK_N
SHAPES = [(1, 100, 300, 128), (3, 70, 200, 64), (70, 130, 260, 128)]


@pytest.mark.parametrize("M,N,K,split_k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_linear_and_reference(M, N, K, split_k, bias, dtype):
    x, w, b = _inputs(M, N, K, dtype, bias)
    y = _both_modes(x, w, b, split_k)
    exact = F.linear(x.float(), w.float(), None if b is None else b.float())
    _close(y, exact, dtype)
    _close(y, linear_invariant_ref(x, w, b, split_k=split_k), dtype)
    assert torch.equal(linear_invariant_triton(x, w, b, split_k=split_k), y)  # the default mode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_are_batch_invariant(dtype):
    M, N, K, split_k = 70, 96, 260, 128
    x, w, b = _inputs(M, N, K, dtype, seed=1)
    full = _both_modes(x, w, b, split_k)
    for i in range(M):  # each row alone: a decode step's row of the same token
        assert torch.equal(linear_invariant_triton(x[i:i + 1], w, b, split_k=split_k), full[i:i + 1]), f"row {i}"
    perm = torch.randperm(M, generator=torch.Generator().manual_seed(2)).to(DEV)
    assert torch.equal(_both_modes(x[perm], w, b, split_k), full[perm])  # the batch in another order
    for rows in (slice(5, 13), slice(60, 70), slice(0, 64)):  # sub-batches, at other tile positions
        assert torch.equal(_both_modes(x[rows], w, b, split_k), full[rows])
    picked = perm[:9]
    assert torch.equal(_both_modes(x[picked], w, b, split_k), full[picked])
    assert torch.equal(_both_modes(x[::3], w, b, split_k), full[::3])  # a strided view of the rows


def test_edges_and_the_default_partition():
    x, w, b = _inputs(5, 40, 100, torch.float32)
    assert linear_invariant_triton(x[:0], w, b).shape == (0, 40)
    y = linear_invariant_triton(x, w, b)  # SPLIT_K = 512 > K: one partition
    _close(y, F.linear(x, w, b), torch.float32)
    xt = x.T.contiguous().T  # column-major rows: copied to unit stride along K, same bits
    assert torch.equal(linear_invariant_triton(xt, w, b), y)
    with pytest.raises(AssertionError):
        linear_invariant_triton(x, w, b, split_k=mm.BLOCK_K + 1)
    with pytest.raises(AssertionError):
        linear_invariant_triton(x, w.double(), b)


def test_the_op_dispatch_and_compile(monkeypatch):
    """specserve::linear_invariant: the Triton kernel where use_triton says so (here forced, the
    interpreter on CPU), else the reference; traced whole by torch.compile(fullgraph=True) through
    its fake, with a dynamic number of rows."""
    from specserve.model.invariant_ops import linear_invariant as op

    x, w, b = _inputs(6, 70, 200, torch.float32)
    monkeypatch.setenv("SPECSERVE_KERNELS", "torch")
    assert torch.equal(op(x, w, b), linear_invariant_ref(x, w, b))
    monkeypatch.setenv("SPECSERVE_KERNELS", "triton")
    eager = op(x, w, b)
    assert torch.equal(eager, linear_invariant_triton(x, w, b))
    assert torch.equal(op(x, w, None), linear_invariant_triton(x, w))

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = op(mode.from_tensor(x), mode.from_tensor(w), None)
    assert fake.shape == (6, 70) and fake.dtype == x.dtype

    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, b: op(x, w, b), fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x, w, b), eager)
    assert torch.equal(compiled(x[:3], w, b), eager[:3])  # another M, the same graph: the same rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes: GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_real_shapes_invariant_on_gpu(dtype):
    """A model's shapes (K = 4096: 8 partitions; N = 4096): a token's row alone (decode), in an
    8-row verification step, in a 64-row batch (split mode) and in a 320-row prefill (fused mode)."""
    x, w, b = _inputs(320, 4096, 4096, dtype, seed=3)
    full = linear_invariant_triton(x, w, b)
    _close(full, F.linear(x.float(), w.float(), b.float()), dtype)
    assert torch.equal(full, _both_modes(x, w, b, mm.SPLIT_K))
    for rows in (slice(0, 1), slice(17, 18), slice(10, 18), slice(0, 64), slice(200, 264)):
        assert torch.equal(_both_modes(x[rows], w, b, mm.SPLIT_K), full[rows]), f"rows {rows}"
    perm = torch.randperm(64, device=DEV)
    assert torch.equal(linear_invariant_triton(x[:64][perm], w, b), full[:64][perm])


# -- `--batch-invariant`: the engine's products through the op (the flag itself acts on CUDA only) --

PROMPTS = [{"prompt_token_ids": [5, 9, 17, 33, 5, 9, 17, 33, 5, 9]}, {"prompt_token_ids": [7, 7, 1, 80, 7, 7]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_the_flag_reaches_the_model_config():
    from specserve.cli import _build_parser

    args = _build_parser().parse_args(["serve", "--batch-invariant"])
    assert args.batch_invariant
    from specserve.config import EngineConfig

    assert EngineConfig.create(batch_invariant=True).model.batch_invariant
    assert not EngineConfig.create().model.batch_invariant


def test_speculation_over_invariant_products_is_plain_decoding(make_llm, tmp_path, default_model_dir, monkeypatch):
    """bfloat16, every product (LM head included), norm, rotary and SiLU x up through the
    kernels: ngram's verify steps give exactly plain decoding's tokens, batch of two; every
    product of every step went through the op (counted by the weights' shapes: the LM head's
    every step, and the layers' products), and every norm and elementwise step through its op."""
    from specserve import kernels
    from tests.conftest import write_tiny_model

    from specserve.model.llama import Linear, RMSNorm

    monkeypatch.setenv("SPECSERVE_KERNELS", "triton")  # interpreted (tests/kernels/conftest.py)
    shapes, calls = [], []
    products = kernels.linear_invariant

    def counted(x, weight, bias=None):
        shapes.append(tuple(weight.shape))
        return products(x, weight, bias)
    monkeypatch.setattr(kernels, "linear_invariant", counted)
    for name in ("rms_norm_invariant", "add_rms_norm_invariant", "rotary", "silu_mul"):
        def op(*args, _fn=getattr(kernels, name), _name=name):
            calls.append(_name)
            return _fn(*args)
        monkeypatch.setattr(kernels, name, op)
    model = write_tiny_model(tmp_path / "m", default_model_dir, vocab_size=256, hidden=64)
    outs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}):
        llm = make_llm(str(model), dtype="bfloat16", speculative_config=spec, num_blocks=32, max_model_len=64)
        llm.engine.runner.model.use_invariant_products()
        outs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)])
        steps = llm.engine.stats.num_steps
        modules = list(llm.engine.runner.model.modules())
        linears = [m for m in modules if isinstance(m, Linear)]
        layer_norms = [m for m in modules if isinstance(m, RMSNorm)]
        assert linears and layer_norms and all(m.invariant for m in linears + layer_norms)
        # every Linear of the model (the LM head too: vocabulary 256) ran through the op, every step;
        # every norm (the final one too) through the norm's
        assert shapes.count((256, 64)) >= steps > 0 and len(shapes) >= steps * (len(linears) - 1)
        # each step: the first norm alone, the others with their residual adds (the final one
        # too), one rotary and one SiLU x up per layer
        layers = len(llm.engine.runner.model.layers)
        assert calls.count("rms_norm_invariant") == steps
        assert calls.count("add_rms_norm_invariant") == steps * (len(layer_norms) - 1)
        assert calls.count("rotary") == calls.count("silu_mul") == steps * layers
        shapes.clear()
        calls.clear()
    assert outs[0] == outs[1]
