"""Draft-model speculation: lossless greedy output, full acceptance with the target as its own
draft, rollback after rejections, and configuration errors."""

from __future__ import annotations

import pytest

from specserve import SamplingParams
from specserve.config import EngineConfig
from tests.conftest import write_tiny_model
from tests.spec_helpers import (HIT_PROMPTS, MAX_TOKENS, MISS_PROMPTS, check_prefix_cache,
                                greedy_baseline, set_num_drafts, token_ids)

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
PROMPTS = [HIT_PROMPTS[1], MISS_PROMPTS[0], HIT_PROMPTS[0]]


@pytest.fixture(scope="module")
def self_draft_llm(make_llm):
    """The default model drafting for itself: every greedy draft must be accepted."""
    return make_llm(max_model_len=1024, speculative_config={
        "method": "draft_model", "model": "smollm2-135m-instruct", "num_speculative_tokens": 5,
        "adaptive": False})


@pytest.fixture(scope="module")
def baseline(llm):
    expect = greedy_baseline(llm)
    return [expect[p] for p in PROMPTS]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_plain_and_all_drafts_accepted(self_draft_llm, baseline, k):
    set_num_drafts(self_draft_llm, k)
    stats = self_draft_llm.engine.stats
    drafted, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
    if k == 3:  # a single request
        assert token_ids(self_draft_llm.generate(HIT_PROMPTS[0], GREEDY))[0] == baseline[2]
    # a batch; the max_tokens=1 request never speculates
    params = [GREEDY, GREEDY, SamplingParams(temperature=0, max_tokens=1)]
    outs = self_draft_llm.generate(PROMPTS, params)
    assert token_ids(outs) == baseline[:2] + [baseline[2][:1]]
    assert outs[2].num_draft_tokens == 0
    assert stats.spec_num_draft_tokens > drafted
    assert stats.spec_num_accepted_tokens - accepted == stats.spec_num_draft_tokens - drafted


def test_shared_memory_budget(self_draft_llm, llm):
    """Target and draft caches share kv_cache_memory_gb: half the blocks of a plain engine."""
    plain = llm.engine.kv.num_total_blocks
    assert self_draft_llm.engine.kv.num_total_blocks == max(16, plain // 2)
    assert self_draft_llm.engine.spec.proposer.runner.num_blocks == self_draft_llm.engine.runner.num_blocks


# -- rollback: a random draft is rejected nearly always -------------------------------------------

@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("draft_pair")
    target = write_tiny_model(root / "target", default_model_dir, seed=0)
    draft = write_tiny_model(root / "draft", default_model_dir, seed=1, layers=1)
    return target, draft


def test_rollback_after_rejections(make_llm, tiny_pair):
    target, draft = tiny_pair
    plain = make_llm(str(target), num_blocks=64, block_size=4, speculative_config=None)
    spec = make_llm(str(target), num_blocks=64, block_size=4, speculative_config={
        "method": "draft_model", "model": str(draft), "num_speculative_tokens": 4,
        "adaptive": False})
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11], list(range(100, 131))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expect = token_ids(plain.generate(prompts, params))
    for _ in range(2):  # the second run starts from prefix-cache hits
        outs = spec.generate(prompts, params)
        assert token_ids(outs) == expect
    stats = spec.engine.stats
    assert stats.spec_num_draft_tokens > 60
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens // 2
    assert stats.prefix_cache_hit_tokens > 0
    check_prefix_cache(spec.engine, [o.prompt_token_ids + o.outputs[0].token_ids for o in outs])
    # a pool too small for everyone at once: preemptions, and still the same output
    small = make_llm(str(target), num_blocks=20, block_size=4, max_num_seqs=8, speculative_config={
        "method": "draft_model", "model": str(draft), "num_speculative_tokens": 4,
        "adaptive": False})
    assert token_ids(small.generate(prompts * 2, params)) == expect * 2
    assert small.engine.stats.num_preemptions > 0


def test_sampled_seeded_is_reproducible(make_llm, tiny_pair):
    target, draft = tiny_pair
    spec = make_llm(str(target), num_blocks=64, block_size=4, speculative_config={
        "method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7, max_tokens=20,
                            ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11]]
    first = token_ids(spec.generate(prompts, params))
    assert token_ids(spec.generate(prompts[:1], params)) == first[:1]
    assert token_ids(spec.generate(prompts, params)) == first


# -- configuration ------------------------------------------------------------------------------

def test_config_errors(make_llm, tiny_pair, tmp_path, default_model_dir, caplog):
    target, _ = tiny_pair
    small_vocab = write_tiny_model(tmp_path / "v16", default_model_dir, vocab_size=16)
    cases = [
        ({"method": "lookahead"}, "unknown method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup"),
        ({"method": "draft_model"}, "needs a draft model"),
        ({"method": "draft_model", "model": str(small_vocab)}, "vocabulary"),
        ('{"method": "ngram", "num_speculative_tokens": ', "not valid JSON"),
        ({"method": "eagle", "depth": 0}, "depth: must be an integer"),
        ({"method": "eagle", "topk": "2"}, "topk: must be an integer"),
        ({"method": "eagle", "lookup_branch": -1}, "lookup_branch: must be an integer >= 0"),
        ({"method": "eagle", "min_draft_prob": 1.0}, r"min_draft_prob: must be a number in \[0, 1\)"),
        ({"method": "eagle", "min_draft_prob": "0.1"}, "min_draft_prob: must be a number"),
        ({"method": "medusa", "min_draft_prob": 0.1}, "min_draft_prob: applies to method eagle, not 'medusa'"),
        ({"method": "suffix", "fairness": 1.0}, r"fairness: must be a number in \[0, 1\)"),
        ({"method": "ngram", "fairness": True}, "fairness: must be a number"),
        ({"method": "suffix", "max_match": 65}, r"max_match: must be an integer in \[prompt_lookup_min \(1\), 64\]"),
        ({"method": "eagle", "lookup": "suffix", "max_match": 0}, "max_match: must be an integer in"),
        ({"method": "ngram", "lookup_branch": 2}, "lookup_branch: applies to method eagle or medusa"),
        ({"method": "ngram", "quantization": "int8"}, "quantization: applies to method eagle or medusa"),
    ]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            make_llm(str(target), num_blocks=16, speculative_config=config)
        if message != "vocabulary":  # the rest is caught before anything loads
            with pytest.raises(ValueError, match=message):
                EngineConfig.create("no-such-model", speculative_config=config)
    llm = make_llm(str(target), num_blocks=16, speculative_config='{"model": "%s"}' % target)
    assert llm.engine.spec.proposer.name == "draft_model"  # a model alone implies draft_model
    caplog.clear()
    llm = make_llm(str(target), num_blocks=16, speculative_config={"method": "ngram", "fairness": 0.3})
    assert llm.engine.spec.policy.fairness == 0.3 and "ignoring keys" not in caplog.text
