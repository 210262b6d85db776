"""n-gram speculation on the default model: lossless greedy output, stops, logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from specserve import SamplingParams
from specserve.spec_decode.ngram import NgramIndex
from tests.spec_helpers import (HIT_PROMPTS, MAX_TOKENS, MISS_PROMPTS, check_prefix_cache,
                                greedy_baseline, set_num_drafts, token_ids)

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def ngram_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """One lookup without a kept index."""
    index = NgramIndex(min_n, max_n)
    index.sync(tokens)
    return index.lookup(tokens, k)


@pytest.fixture(scope="module")
def ngram_llm(make_llm):
    return make_llm(max_model_len=2048, speculative_config={
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
        "prompt_lookup_min": 1})


def test_lookup_most_recent_longest_match():
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_lookup(ctx, 1, 3, 2) == [7, 8]  # "2 3" last seen before "7 8"
    assert ngram_lookup([4, 5, 6], 1, 3, 2) == []
    # a period-2 loop keeps going past the end of the context
    assert ngram_lookup([1, 2, 1, 2, 1, 2], 2, 2, 5) == [1, 2, 1, 2, 1]
    # prompt_lookup_min bounds the match length
    assert ngram_lookup([7, 1, 5, 1], 2, 3, 2) == []
    assert ngram_lookup([7, 1, 5, 1], 1, 3, 2) == [5, 1]


def _scan(ctx: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The lookup by its definition: scan the context for the suffix, longest first."""
    a, length = np.array(ctx), len(ctx)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        found = [i for i in range(length - n) if (a[i:i + n] == a[length - n:]).all()]
        if found:
            out: list[int] = []
            for j in range(k):
                p = found[-1] + n + j
                out.append(ctx[p] if p < length else out[p - length])
            return out
    return []


@pytest.mark.parametrize("min_n,max_n", [(1, 4), (2, 3), (3, 3)])
def test_index_grown_step_by_step_equals_a_scan(min_n, max_n):
    rng = np.random.default_rng(min_n * 10 + max_n)
    index, tokens = NgramIndex(min_n, max_n), []
    for step in range(120):
        tokens += rng.integers(0, 4, size=int(rng.integers(1, 4))).tolist()  # a few committed tokens a step
        index.sync(tokens)
        k = int(rng.integers(1, 7))
        assert index.lookup(tokens, k) == _scan(tokens, min_n, max_n, k), (step, tokens)
    index.sync(tokens[:10])  # shorter than indexed: rebuilt
    assert index.lookup(tokens[:10], 3) == _scan(tokens[:10], min_n, max_n, 3)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_plain_decoding(llm, ngram_llm, k):
    expect = greedy_baseline(llm)
    set_num_drafts(ngram_llm, k)
    engine = ngram_llm.engine
    before = engine.stats.spec_num_accepted_tokens
    if k == 3:  # a single request
        assert token_ids(ngram_llm.generate(HIT_PROMPTS[1], GREEDY))[0] == expect[HIT_PROMPTS[1]]
    # a batch where some requests speculate and one finds nothing to copy
    engine.kv.pool.reset_prefix_cache()
    prompts = HIT_PROMPTS + MISS_PROMPTS[:1]
    outs = ngram_llm.generate(prompts, GREEDY)
    assert token_ids(outs) == [expect[p] for p in prompts]
    assert engine.stats.spec_num_accepted_tokens > before, "prompt lookup never hit"
    # rejected drafts never reach the prefix cache
    check_prefix_cache(engine, [o.prompt_token_ids + o.outputs[0].token_ids for o in outs])


def test_logprobs_and_penalties_match(llm, ngram_llm):
    set_num_drafts(ngram_llm, 4)
    params = [SamplingParams(temperature=0, max_tokens=24, logprobs=3),
              SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3,
                             frequency_penalty=0.2)]
    prompts = [HIT_PROMPTS[0], HIT_PROMPTS[0]]
    ref = llm.generate(prompts, params)
    got = ngram_llm.generate(prompts, params)
    assert got[0].num_accepted_tokens > 0
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    for a, b in zip(got[0].outputs[0].logprobs, ref[0].outputs[0].logprobs, strict=True):
        assert a.token_id == b.token_id
        assert abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert np.allclose([v for _, v in a.top], [v for _, v in b.top], atol=1e-4)
    assert got[1].outputs[0].token_ids == ref[1].outputs[0].token_ids


def test_stops_inside_an_accepted_run(llm, ngram_llm):
    """Stop token, stop string and max_tokens end the output exactly where plain decoding
    would, even when they fall inside a run of accepted drafts (k = 5, mostly accepted)."""
    set_num_drafts(ngram_llm, 5)
    prompt = HIT_PROMPTS[0]
    full = greedy_baseline(llm)[prompt]
    tok = llm.get_tokenizer()
    stop_tok = full[11]
    text = tok.decode(full)
    stop = text[len(text) // 2:len(text) // 2 + 5]
    cut = next(m for m in range(1, len(full) + 1) if stop in tok.decode(full[:m]))
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_tok]),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=stop),
              SamplingParams(temperature=0, max_tokens=7)]
    results = ngram_llm.generate([prompt] * 3, params)
    assert sum(r.num_accepted_tokens for r in results) > 0  # the runs really were speculative
    outs = [o.outputs[0] for o in results]
    assert outs[0].token_ids == full[:full.index(stop_tok) + 1]
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == stop_tok
    assert outs[1].token_ids == full[:cut] and outs[1].text == text[:text.index(stop)]
    assert outs[1].finish_reason == "stop" and outs[1].stop_reason == stop
    assert outs[2].token_ids == full[:7] and outs[2].finish_reason == "length"


def test_realized_times_the_engines_own_steps(ngram_llm):
    """Realized's samples are the engine's own step time: a pause between steps (another
    engine stepping in the same process, an idle server) is not charged to either mode."""
    import time

    spec, samples = ngram_llm.engine.spec, []
    observe, adaptive = spec.policy.realized.observe, spec.policy.adaptive
    spec.policy.realized.observe = lambda b, s, seconds, *a: (samples.append(seconds), observe(b, s, seconds, *a))
    spec.policy.adaptive = True  # set_num_drafts turns it off
    try:
        prompt = ngram_llm.engine.tokenizer.encode(HIT_PROMPTS[0])
        ngram_llm.engine.add_request("paused", prompt, GREEDY)
        longest = 0.0
        while ngram_llm.engine.has_unfinished_requests():
            step_start = time.perf_counter()
            ngram_llm.engine.step()
            longest = max(longest, time.perf_counter() - step_start)
            time.sleep(max(0.1, 3 * longest))  # a pause longer than any step
    finally:
        spec.policy.realized.observe, spec.policy.adaptive = observe, adaptive
    # a sample is the end of one step and the start of the next, never the pause between them
    assert len(samples) >= 4 and max(samples) <= 2 * longest


def test_each_step_kind_the_decoder_chooses_is_counted(llm, ngram_llm):
    """EngineStats (and so /metrics' specserve:spec_decode_steps) count the steps with requests
    to draft for by the decoder's choice: drafting, lookup chains alone, or plain; steps
    without such requests (a prefill's) are not counted. Output stays plain decoding's."""
    from specserve.spec_decode.cost_model import LOOKUP_ONLY, PLAIN, SPEC

    spec, stats = ngram_llm.engine.spec, ngram_llm.engine.stats
    choices, chosen = [SPEC, PLAIN, LOOKUP_ONLY, PLAIN, SPEC, SPEC, SPEC], []
    speculate, adaptive = spec._speculate, spec.policy.adaptive

    def choose(batch, eligible, step_start):  # (a step with nothing to draft for: plain, not counted)
        if eligible:
            chosen.append(choices[len(chosen) % len(choices)])
        return chosen[-1] if eligible else PLAIN
    spec._speculate = choose
    spec.policy.adaptive = True  # set_num_drafts turns it off
    before = (stats.spec_steps_drafting, stats.spec_steps_lookup_only, stats.spec_steps_plain)
    try:
        out = ngram_llm.generate([HIT_PROMPTS[0]], GREEDY)
    finally:
        spec._speculate, spec.policy.adaptive = speculate, adaptive
    after = (stats.spec_steps_drafting, stats.spec_steps_lookup_only, stats.spec_steps_plain)
    counted = [a - b for a, b in zip(after, before)]
    assert len(chosen) > len(choices)
    assert counted == [chosen.count(SPEC), chosen.count(LOOKUP_ONLY), chosen.count(PLAIN)]
    assert token_ids(out) == token_ids(llm.generate([HIT_PROMPTS[0]], GREEDY))
    plain = llm.engine.stats
    assert plain.spec_steps_drafting == plain.spec_steps_lookup_only == plain.spec_steps_plain == 0
