"""n-gram speculation on the default model: lossless greedy output, stops, logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from specserve import SamplingParams
from specserve.spec.ngram import ngram_lookup
from tests.spec_helpers import HIT_PROMPTS, MISS_PROMPTS, check_prefix_cache, set_num_drafts, token_ids

GREEDY = SamplingParams(temperature=0, max_tokens=48)


@pytest.fixture(scope="module")
def ngram_llm(make_llm):
    return make_llm(max_model_len=2048, speculative_config={
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
        "prompt_lookup_min": 1})


@pytest.fixture(scope="module")
def baseline(llm):
    return token_ids(llm.generate(HIT_PROMPTS + MISS_PROMPTS, GREEDY))


def test_lookup_most_recent_longest_match():
    ctx = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert ngram_lookup(ctx, 1, 3, 2) == [7, 8]  # "2 3" last seen before "7 8"
    assert ngram_lookup(np.array([4, 5, 6]), 1, 3, 2) == []
    # a period-2 loop keeps going past the end of the context
    assert ngram_lookup(np.array([1, 2, 1, 2, 1, 2]), 2, 2, 5) == [1, 2, 1, 2, 1]
    # prompt_lookup_min bounds the match length
    assert ngram_lookup(np.array([7, 1, 5, 1]), 2, 3, 2) == []
    assert ngram_lookup(np.array([7, 1, 5, 1]), 1, 3, 2) == [5, 1]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_plain_decoding(ngram_llm, baseline, k):
    set_num_drafts(ngram_llm, k)
    stats = ngram_llm.engine.stats
    before = stats.spec_num_accepted_tokens
    # single requests
    for prompt, expect in zip(HIT_PROMPTS, baseline):
        assert token_ids(ngram_llm.generate(prompt, GREEDY))[0] == expect
    assert stats.spec_num_accepted_tokens > before, "prompt lookup never hit"
    # a batch where some requests speculate and some find nothing to copy
    assert token_ids(ngram_llm.generate(HIT_PROMPTS + MISS_PROMPTS, GREEDY)) == baseline


def test_logprobs_and_penalties_match(llm, ngram_llm):
    set_num_drafts(ngram_llm, 4)
    params = [SamplingParams(temperature=0, max_tokens=32, logprobs=3),
              SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.3,
                             frequency_penalty=0.2)]
    prompts = [HIT_PROMPTS[0], HIT_PROMPTS[0]]
    ref = llm.generate(prompts, params)
    got = ngram_llm.generate(prompts, params)
    assert got[0].num_accepted_tokens > 0
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    for a, b in zip(got[0].outputs[0].logprobs, ref[0].outputs[0].logprobs):
        assert a.token_id == b.token_id
        assert abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert np.allclose([v for _, v in a.top], [v for _, v in b.top], atol=1e-4)
    assert got[1].outputs[0].token_ids == ref[1].outputs[0].token_ids


def test_stops_inside_an_accepted_run(llm, ngram_llm, baseline):
    set_num_drafts(ngram_llm, 5)
    full = baseline[0]
    tok = llm.get_tokenizer()
    # stop token: the 12th output token ends the request, even mid-run
    cut = 11
    stop_tok = full[cut]
    first = full.index(stop_tok)
    out = ngram_llm.generate(HIT_PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=48, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == full[:first + 1] and out.finish_reason == "stop"
    # stop string: text cut right before it, tokens up to the one completing it
    text = tok.decode(full)
    stop = text[len(text) // 2:len(text) // 2 + 6]
    ref = llm.generate(HIT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=48, stop=stop))
    got = ngram_llm.generate(HIT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=48, stop=stop))
    assert got[0].outputs[0].text == ref[0].outputs[0].text == text[:text.index(stop)]
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    # max_tokens: exactly that many tokens
    for n in (1, 2, 7):
        out = ngram_llm.generate(HIT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=n))
        assert out[0].outputs[0].token_ids == full[:n]
        assert out[0].outputs[0].finish_reason == "length"


def test_prefix_cache_holds_committed_tokens_only(ngram_llm):
    set_num_drafts(ngram_llm, 5)
    ngram_llm.engine.kv.pool.reset_prefix_cache()
    outs = ngram_llm.generate(HIT_PROMPTS + MISS_PROMPTS, GREEDY)
    assert ngram_llm.engine.kv.pool.num_cached > 0
    check_prefix_cache(ngram_llm.engine, [o.prompt_token_ids + o.outputs[0].token_ids
                                          for o in outs])
