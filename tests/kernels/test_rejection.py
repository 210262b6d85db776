import importlib.util

import pytest
import torch

from specserve.kernels import rejection_sample
from specserve.kernels.rejection import rejection_sample_ref, rejection_sample_triton

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = [pytest.param(rejection_sample_triton, marks=needs_triton, id="triton"),
         pytest.param(rejection_sample_ref, id="ref")]


def _dev(*ts):
    return [t.to(DEV) if t is not None else None for t in ts]


def _random_inputs(B, K, V, with_q, seed, greedy_frac=0.3, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    tp = torch.softmax(torch.randn(B, K + 1, V, generator=g) * sharp, -1)
    dp = torch.softmax(torch.randn(B, K, V, generator=g) * sharp, -1) if with_q else None
    # drafts: mostly the target argmax so that long accepted runs occur
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.6, tp[:, :K].argmax(-1),
                         torch.randint(0, V, (B, K), generator=g))
    nd = torch.randint(0, K + 1, (B,), generator=g)
    drafts = torch.where(torch.arange(K)[None] < nd[:, None], drafts, -1)  # padding = -1
    greedy = torch.rand(B, generator=g) < greedy_frac
    u = torch.rand(B, K, generator=g)
    e = -torch.log(torch.rand(B, K + 1, V, generator=g))
    return _dev(drafts, nd, dp, tp, greedy, u, e)


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_known_answers(impl):
    V = 10
    # target argmaxes per position: 3, 5, 7, 9 (K = 3 drafts + bonus)
    logits = torch.full((3, 4, V), -1.0)
    for i, t in enumerate([3, 5, 7, 9]):
        logits[:, i, t] = 2.0
    drafts = torch.tensor([[3, 5, 1],   # mismatch at 2 -> emit 7
                           [3, 5, 7],   # all accepted -> bonus 9
                           [4, 5, 7]])  # mismatch at 0 -> emit 3
    nd = torch.tensor([3, 3, 3])
    args = _dev(drafts, nd, None, logits, torch.ones(3, dtype=torch.bool), torch.rand(3, 3), torch.ones(3, 4, V))
    out, n = impl(*args)
    assert out.tolist() == [[3, 5, 7, -1], [3, 5, 7, 9], [3, -1, -1, -1]]
    assert n.tolist() == [3, 4, 1]
    # num_draft limits the walk: only 2 drafts -> bonus from position 2 (argmax 7)
    out, n = impl(*_dev(drafts[1:2], torch.tensor([2]), None, logits[1:2], torch.tensor([True]),
                        torch.rand(1, 3), torch.ones(1, 4, V)))
    assert out.tolist() == [[3, 5, 7, -1]] and n.tolist() == [3]


@pytest.mark.parametrize("impl", IMPLS)
def test_sampled_all_accepted_bonus_and_num_draft_zero(impl):
    V, K = 6, 3
    tp = torch.zeros(2, K + 1, V)
    tp[:, :K, 2] = 1.0  # p(x=2) = 1 -> always accepted
    tp[:, K] = torch.tensor([0.1, 0.2, 0.3, 0.1, 0.2, 0.1])
    e = torch.ones(2, K + 1, V)
    e[:, K, 4] = 0.1  # exponential race winner at the bonus position: 0.2 / 0.1
    e[:, 0, 5] = 0.01  # at position 0 a draw from p picks 5 (0.1 / 0.01)
    tp[1, 0] = torch.tensor([0.1, 0.2, 0.3, 0.1, 0.2, 0.1])
    drafts = torch.full((2, K), 2)
    nd = torch.tensor([K, 0])
    out, n = impl(*_dev(drafts, nd, None, tp, torch.zeros(2, dtype=torch.bool), torch.full((2, K), 0.999), e))
    assert out.tolist() == [[2, 2, 2, 4], [5, -1, -1, -1]]
    assert n.tolist() == [4, 1]


@pytest.mark.parametrize("impl", IMPLS)
def test_sampled_rejection_uses_residual(impl):
    V = 4
    tp = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.25] * 4]])
    dp = torch.tensor([[[0.9, 0.1, 0.0, 0.0]]])  # residual max(0, p - q) = [0, .4, 0, 0]
    e = torch.ones(1, 2, V)
    e[0, 0, 0] = 1e-6  # would win a draw from p, must not win from the residual
    out, n = impl(*_dev(torch.tensor([[0]]), torch.tensor([1]), dp, tp, torch.tensor([False]),
                        torch.tensor([[0.9]]), e))  # 0.9 * 0.9 >= 0.5 -> reject
    assert out.tolist() == [[1, -1]] and n.tolist() == [1]


@needs_triton
@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("B,K,V", [(48, 4, 8), (16, 1, 33), (6, 3, 5000), (5, 0, 16)])
def test_triton_matches_ref(with_q, B, K, V):
    args = _random_inputs(B, K, V, with_q, seed=B * 7 + K + V)
    out_t, n_t = rejection_sample_triton(*args)
    out_r, n_r = rejection_sample_ref(*args)
    assert torch.equal(n_t, n_r)
    assert torch.equal(out_t, out_r)
    assert (n_r >= 1).all() and (n_r <= args[1] + 1).all()


def _first_token_counts(impl, p, q, N, seed, uniforms_override=None):
    g = torch.Generator().manual_seed(seed)
    V = p.numel()
    tp = p.expand(N, 2, V).contiguous()
    if q is None:  # one-hot drafts (n-gram): draft token fixed to 0
        drafts, dp = torch.zeros(N, 1, dtype=torch.long), None
    else:
        drafts = torch.multinomial(q, N, replacement=True, generator=g)[:, None]
        dp = q.expand(N, 1, V).contiguous()
    u = torch.rand(N, 1, generator=g) if uniforms_override is None else torch.full((N, 1), uniforms_override)
    e = -torch.log(torch.rand(N, 2, V, generator=g))
    out, _ = impl(drafts, torch.ones(N, dtype=torch.long), dp, tp, torch.zeros(N, dtype=torch.bool), u, e)
    return torch.bincount(out[:, 0], minlength=V).double()


P = torch.tensor([0.05, 0.3, 0.1, 0.15, 0.02, 0.18, 0.12, 0.08])


def _expected(counts):
    return (P.double() / P.double().sum() * counts.sum()).numpy()

Q = torch.tensor([0.3, 0.05, 0.2, 0.05, 0.2, 0.05, 0.1, 0.05])


@pytest.mark.parametrize("q", [Q, None], ids=["draft_probs", "one_hot"])
def test_statistical_first_token_follows_target(q):
    scipy_stats = pytest.importorskip("scipy.stats")
    N = 40000
    counts = _first_token_counts(rejection_sample_ref, P, q, N, seed=123)
    assert scipy_stats.chisquare(counts.numpy(), _expected(counts)).pvalue > 1e-3
    # Broken rule (always accept: u -> 0) must be detected: first token ~ q instead.
    bad = _first_token_counts(rejection_sample_ref, P, q, N, seed=123, uniforms_override=1e-12)
    assert scipy_stats.chisquare(bad.numpy(), _expected(bad)).pvalue < 1e-6


@needs_triton
def test_statistical_triton_small():
    scipy_stats = pytest.importorskip("scipy.stats")
    N = 1200  # interpreter: ~6 s
    counts = _first_token_counts(lambda *a: rejection_sample_triton(*_dev(*a)), P, Q, N, seed=7)
    assert scipy_stats.chisquare(counts.numpy(), _expected(counts)).pvalue > 1e-3


def test_dispatch_cpu():
    args = _random_inputs(4, 2, 8, True, 0)
    args = [a.cpu() if a is not None else None for a in args]
    o1, n1 = rejection_sample(*args)
    o2, n2 = rejection_sample_ref(*args)
    assert torch.equal(o1, o2) and torch.equal(n1, n2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("with_q", [True, False])
def test_gpu_real_shapes(with_q):
    args = _random_inputs(64, 8, 32000, with_q, seed=0, greedy_frac=0.5, sharp=8.0)
    out_t, n_t = rejection_sample_triton(*args)
    out_r, n_r = rejection_sample_ref(*args)
    assert torch.equal(n_t, n_r) and torch.equal(out_t, out_r)
