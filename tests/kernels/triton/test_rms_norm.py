"""The batch-invariant RMSNorm (specserve/kernels/triton/rms_norm.py, the op in model/invariant_ops.py):
agreement with the model's RMSNorm, rows that keep their bits alone, in a batch and permuted, the op's
dispatch and its trace by torch.compile. On CPU the kernel runs under the Triton interpreter
(tests/kernels/conftest.py); one test runs a model's width on a GPU only."""
import importlib.util

import pytest
import torch

from specserve.kernels.triton.rms_norm import rms_norm_invariant_triton, rms_norm_ref

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(M, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, N, generator=g) * 3).to(DEV, dtype)
    x[M // 2, : N // 3] *= 1e3  # a row with outliers
    w = (1 + torch.randn(N, generator=g) / 4).to(DEV, dtype)
    return x, w


@pytest.mark.parametrize("M,N", [(1, 64), (5, 576), (33, 100)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_the_models_norm_and_rows_are_invariant(M, N, dtype):
    x, w = _inputs(M, N, dtype)
    y = rms_norm_invariant_triton(x, w, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    # the model's formula; bfloat16 rounds twice (normalised, then weighted), each rounding may
    # land one ulp (2^-8 relative) apart from PyTorch's
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(y.float(), rms_norm_ref(x, w, 1e-5).float(), rtol=tol, atol=tol)
    for rows in (slice(0, 1), slice(M - 1, M), slice(M // 2, M)):
        assert torch.equal(rms_norm_invariant_triton(x[rows], w, 1e-5), y[rows]), f"rows {rows}"
    perm = torch.randperm(M, device=DEV)
    assert torch.equal(rms_norm_invariant_triton(x[perm], w, 1e-5), y[perm])
    strided = torch.cat([x, x], 1)[:, :N]  # rows of another stride
    assert torch.equal(rms_norm_invariant_triton(strided, w, 1e-5), y)
    assert rms_norm_invariant_triton(x[:0], w, 1e-5).shape == (0, N)


def test_the_op_dispatch_and_compile(monkeypatch):
    """specserve::rms_norm_invariant: the kernel where use_triton says so (forced here: the
    interpreter on CPU), else the reference; any leading shape (q/k norms are per head); traced
    whole by torch.compile(fullgraph=True) through its fake, with a dynamic number of rows."""
    from specserve.model.invariant_ops import rms_norm_invariant as op

    x, w = _inputs(6, 64, torch.float32)
    monkeypatch.setenv("SPECSERVE_KERNELS", "torch")
    assert torch.equal(op(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    monkeypatch.setenv("SPECSERVE_KERNELS", "triton")
    eager = op(x, w, 1e-6)
    assert torch.equal(eager, rms_norm_invariant_triton(x, w, 1e-6))
    heads = x.view(6, 4, 16)
    assert torch.equal(op(heads, w[:16], 1e-6), rms_norm_invariant_triton(x.view(24, 16), w[:16], 1e-6).view(6, 4, 16))

    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: op(x, w, 1e-6), fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x, w), eager)
    assert torch.equal(compiled(x[:3], w), eager[:3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only")
def test_a_models_width_on_gpu():
    """bfloat16 at the default model's width and an 8B model's: a row alone, in 8 and in 320."""
    for N in (576, 4096):
        x, w = _inputs(320, N, torch.bfloat16, seed=2)
        full = rms_norm_invariant_triton(x, w, 1e-5)
        torch.testing.assert_close(full.float(), rms_norm_ref(x, w, 1e-5).float(), rtol=2 ** -6, atol=2 ** -6)
        for rows in (slice(0, 1), slice(17, 18), slice(10, 18), slice(200, 264)):
            assert torch.equal(rms_norm_invariant_triton(x[rows], w, 1e-5), full[rows]), f"{N}: rows {rows}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_residual_add_in_the_same_launch(dtype):
    """add_rms_norm: the sum rounded as the model adds (bit for bit), its norm the norm's bits."""
    from specserve.kernels.triton.rms_norm import add_rms_norm_invariant_triton

    x, w = _inputs(7, 576, dtype)
    r, _ = _inputs(7, 576, dtype, seed=1)
    normed, total = add_rms_norm_invariant_triton(x, r, w, 1e-5)
    if DEV == "cpu" and dtype == torch.bfloat16:  # the interpreter's float32 -> bfloat16 rounds its own way
        torch.testing.assert_close(total, x + r, rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(total, x + r)
    assert torch.equal(normed, rms_norm_invariant_triton(total, w, 1e-5))
    assert torch.equal(add_rms_norm_invariant_triton(x[3:5], r[3:5], w, 1e-5)[0], normed[3:5])
