"""Sampled speculation is lossless: the tokens of a speculative engine follow the target's
distribution exactly (chi-square on a 16-token vocabulary), for seeded requests (verified
against plain sampling's own draws) and unseeded ones (the rejection rule), under a grammar
too (the constrained distribution, drafts the grammar forbids cut), and the test has the power
to catch a broken rule (always accept)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import specserve.sampling.rejection as rejection
from specserve import SamplingParams
from specserve.structured import StructuredOutput
from tests.conftest import write_tiny_model

VOCAB = 16
PROMPT = [3, 7, 1, 12, 5]
NUM_SAMPLES = 3000
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("sampled")
    target = write_tiny_model(root / "target", default_model_dir, vocab_size=VOCAB, seed=0)
    draft = write_tiny_model(root / "draft", default_model_dir, vocab_size=VOCAB, seed=3, layers=1)
    return target, draft


# a grammar over token ids: a different allowed set at each of the three positions
ALLOWED = ([3, 5, 7, 9], [1, 4, 6, 8, 10], [3, 4, 5, 11, 12, 13])
GRAMMAR = "start: a b c\n" + "\n".join(f"{name}: " + " | ".join(f"<[{t}]>" for t in ids)
                                        for name, ids in zip("abc", ALLOWED))


def exact_third_token(target_dir, allowed: tuple[list[int], ...] | None = None) -> np.ndarray:
    """P(3rd generated token) under the target with TEMPERATURE (restricted to `allowed[i]` at
    position i when given), marginalised over the first two (V^2 paths), computed with
    Hugging Face transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        def next_probs(seqs, pos):
            logits = model(torch.tensor(seqs)).logits[:, -1].double() / TEMPERATURE
            if allowed is not None:
                banned = torch.ones(VOCAB, dtype=torch.bool)
                banned[allowed[pos]] = False
                logits[:, banned] = -torch.inf
            return logits.softmax(-1)

        p1 = next_probs([PROMPT], 0)[0]  # [V]
        p2 = next_probs([PROMPT + [a] for a in range(VOCAB)], 1)  # [V, V]
        p3 = next_probs([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)], 2)
        joint = (p1[:, None, None] * p2[:, :, None] * p3.view(VOCAB, VOCAB, VOCAB)).nan_to_num()
    return joint.sum((0, 1)).numpy()


def third_tokens(llm, seeded: bool = True, structured: StructuredOutput | None = None) -> np.ndarray:
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=3, ignore_eos=True, seed=s if seeded else None,
                             structured=structured)
              for s in range(NUM_SAMPLES)]
    outs = llm.generate([PROMPT] * NUM_SAMPLES, params)
    return np.bincount([o.outputs[0].token_ids[2] for o in outs], minlength=VOCAB)


@pytest.fixture(scope="module")
def target_probs(models) -> np.ndarray:
    return exact_third_token(models[0])


@pytest.fixture(scope="module")
def spec_llm(make_llm, models):
    target, draft = models
    # 3000 sequences of 8 tokens: 2 tokens a block, 1 block each for drafts
    return make_llm(str(target), dtype="float32", num_blocks=8192, block_size=2, max_num_seqs=512,
                    max_num_batched_tokens=4096, speculative_config={
                        "method": "draft_model", "model": str(draft), "num_speculative_tokens": 2,
                        "adaptive": False})


def _pvalue(counts, probs) -> float:
    keep = probs * counts.sum() >= 5  # pool rare tokens into one cell
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_speculative_sampling_matches_target(spec_llm, target_probs, seeded):
    stats = spec_llm.engine.stats
    drafted, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
    counts = third_tokens(spec_llm, seeded)
    # drafts were really verified, with rejections, and the draft differs from the target
    drafted, accepted = stats.spec_num_draft_tokens - drafted, stats.spec_num_accepted_tokens - accepted
    assert drafted >= NUM_SAMPLES
    assert 0.1 < accepted / drafted < 0.9
    assert _pvalue(counts, target_probs) > 1e-3


def test_grammar_constrained_sampling_matches_the_constrained_target(spec_llm, models):
    """Every verify row is masked by the grammar state after the drafts before it: the third
    token follows the target restricted to the grammar at each position (drafts from an
    unconstrained draft model, so many are cut or rejected)."""
    stats = spec_llm.engine.stats
    drafted = stats.spec_num_draft_tokens
    counts = third_tokens(spec_llm, seeded=False, structured=StructuredOutput(grammar=GRAMMAR))
    assert stats.spec_num_draft_tokens - drafted >= NUM_SAMPLES // 4  # drafts survived the cut
    assert counts[[t for t in range(VOCAB) if t not in ALLOWED[2]]].sum() == 0
    assert _pvalue(counts, exact_third_token(models[0], ALLOWED)) > 1e-3


def test_broken_rules_are_detected(spec_llm, target_probs, monkeypatch):
    """Accepting every draft samples from the draft's distribution: the test must notice."""
    with monkeypatch.context() as m:
        m.setattr(rejection, "uniform_at", lambda s, p, c: torch.zeros(s.shape))
        assert _pvalue(third_tokens(spec_llm, seeded=False), target_probs) < 1e-6
    monkeypatch.setattr(rejection, "coupled_tokens", lambda probs, s, p: probs.argmax(-1))
    assert _pvalue(third_tokens(spec_llm), target_probs) < 1e-6


@pytest.fixture(scope="module")
def suffix_llm(make_llm, models):
    # suffix trees: many branches from the outputs of the requests that finished before
    return make_llm(str(models[0]), dtype="float32", num_blocks=8192, block_size=2,
                    max_num_seqs=256, max_num_batched_tokens=4096, speculative_config={
                        "method": "suffix", "num_speculative_tokens": 4, "adaptive": False})


def test_suffix_trees_sample_the_target(suffix_llm, target_probs):
    """One-hot trees with several branches per node, from other requests' outputs: the rule
    for trees keeps the target's distribution."""
    stats = suffix_llm.engine.stats
    drafted, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
    counts = third_tokens(suffix_llm, seeded=False)
    drafted, accepted = stats.spec_num_draft_tokens - drafted, stats.spec_num_accepted_tokens - accepted
    assert drafted >= NUM_SAMPLES // 2 and 0.05 < accepted / drafted < 0.95
    assert _pvalue(counts, target_probs) > 1e-3
