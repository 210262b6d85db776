"""The batched sampler: filters, penalties, and the hash-noise exponential race."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.request import SamplingParams
from specserve.sampling import (SamplingBatch, TokenCounts, exponential_noise, processed_probs, row_counts, sample,
                                uniform_noise)


def _batch(params_list, vocab=8, counts=None):
    n = len(params_list)
    return SamplingBatch.build(params_list, [100 + i for i in range(n)], [3] * n, vocab, "cpu", counts)


def test_top_k_top_p_min_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05, 0.0, 0.0, 0.0]]) + 1e-12).repeat(3, 1)
    b = _batch([SamplingParams(top_k=2), SamplingParams(top_p=0.8), SamplingParams(min_p=0.25)])
    probs = processed_probs(logits, b)
    assert torch.count_nonzero(probs[0]) == 2
    assert torch.count_nonzero(probs[1]) == 3  # 0.5 + 0.2 < 0.8 needs the third token
    assert torch.count_nonzero(probs[2]) == 3  # >= 0.25 * 0.5
    assert torch.allclose(probs.sum(-1), torch.ones(3))


def test_noise_is_uniform_and_keyed():
    u = uniform_noise(torch.tensor([1, 1, 2]), torch.tensor([5, 6, 5]), 20000)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    again = uniform_noise(torch.tensor([2]), torch.tensor([5]), 20000)
    assert torch.equal(u[2], again[0]) and not torch.equal(u[0], u[1])


def test_exponential_race_follows_the_distribution():
    target = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0, 0.0])
    logits = torch.log(torch.tensor(target, dtype=torch.float32) + 1e-30)
    n = 4000
    b = SamplingBatch.build([SamplingParams(temperature=1.0)] * n, list(range(n)), [1] * n, 8, "cpu")
    draws = sample(logits.repeat(n, 1), b).numpy()
    counts = np.bincount(draws, minlength=8)
    assert counts[6:].sum() == 0
    assert chisquare(counts[:6], target[:6] * n).pvalue > 1e-3


def test_penalties_apply_to_greedy_rows():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    counts = TokenCounts([1], 4, "cpu").sync([1, 0, 0])  # prompt [1], output [0, 0]
    b = _batch([SamplingParams(temperature=0, frequency_penalty=1.0)], 4, row_counts([counts], [[]]))
    assert sample(logits, b).item() == 1


def test_token_counts_are_kept_incrementally_and_rows_add_their_drafts():
    counts = TokenCounts([5, 5, 2], 8, "cpu")
    counts.sync([5, 5, 2, 3])
    counts.sync([5, 5, 2, 3, 3, 7])  # only the new tokens are added
    assert counts.output.tolist() == [0, 0, 0, 2, 0, 0, 0, 1] and counts.counted == 3
    assert counts.seen.nonzero().flatten().tolist() == [2, 3, 5, 7]
    output, seen = row_counts([counts, counts], [[], [1, 3]])  # the second row follows drafts 1, 3
    assert output[0].tolist() == counts.output.tolist()
    assert output[1].tolist() == [0, 1, 0, 3, 0, 0, 0, 1] and bool(seen[1, 1])


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_greedy_and_sampled_rows_mix(temperature):
    logits = torch.randn(2, 16)
    b = _batch([SamplingParams(temperature=0), SamplingParams(temperature=temperature)], vocab=16)
    out = sample(logits, b)
    assert out[0].item() == logits[0].argmax().item()
    if temperature == 0:
        assert out[1].item() == logits[1].argmax().item()
    else:  # the exponential race with the row's own noise, keyed by its seed and position
        probs = torch.softmax(logits[1] / temperature, -1)
        noise = exponential_noise(torch.tensor([101]), torch.tensor([3]), 16)[0]
        assert out[1].item() == (probs / noise).argmax().item()
