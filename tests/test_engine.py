"""Engine behaviour on the default model: prefix caching, preemption, chunked prefill, API."""

import pytest

from specserve import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LONG_PROMPT = ("The history of the printing press begins in the fifteenth century, when movable "
               "type changed how books were made, sold and read across Europe. ") * 4


def test_prefix_cache_computes_only_new_tokens(llm):
    engine = llm.engine
    first = llm.generate(LONG_PROMPT, GREEDY)[0]
    n = len(first.prompt_token_ids)
    before = engine.stats.computed_tokens_total
    second = llm.generate(LONG_PROMPT, GREEDY)[0]
    computed = engine.stats.computed_tokens_total - before
    bs = engine.kv.block_size
    cached = (n - 1) // bs * bs
    assert second.num_cached_tokens == cached
    # the uncached prompt tail, then one token per decode step (the first comes from prefill)
    assert computed == (n - cached) + (GREEDY.max_tokens - 1)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_preemption_keeps_outputs(llm, make_llm):
    prompts = [f"Story {i}: once upon a time there was a {w}" for i, w in
               enumerate(["dragon", "robot", "king", "cat", "ship"])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    small = make_llm(num_blocks=8, block_size=16, max_model_len=128)  # 128 tokens for ~190 needed
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert small.engine.stats.num_preemptions > 0
    assert got == expected


def test_chunked_prefill_mixed_with_decodes(llm, make_llm):
    prompts = [LONG_PROMPT[:300], "Hi", "Count: one, two, three,", LONG_PROMPT[:160]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    tight = make_llm(max_num_batched_tokens=24, max_num_seqs=3, enable_prefix_caching=False)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert got == expected


def test_chat_stop_and_finish_reasons(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}],
                   SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason in ("stop", "length") and out.text
    base = llm.generate("Count: one, two, three,", SamplingParams(temperature=0, max_tokens=8))[0]
    assert base.outputs[0].finish_reason == "length" and len(base.outputs[0].token_ids) == 8
    stop_word = base.outputs[0].text.split(",")[1]  # the second word the model writes
    cut = llm.generate("Count: one, two, three,",
                       SamplingParams(temperature=0, max_tokens=8, stop=[stop_word]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_word
    assert stop_word not in cut.text and base.outputs[0].text.startswith(cut.text)
    tok = base.outputs[0].token_ids[2]
    by_id = llm.generate("Count: one, two, three,",
                         SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[tok]))[0].outputs[0]
    assert by_id.token_ids == base.outputs[0].token_ids[:3] and by_id.finish_reason == "stop"


def test_seeded_sampling_is_batch_independent(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16)
    alone = llm.generate("Tell me a joke.", params)[0].outputs[0].token_ids
    crowd = llm.generate(["Other prompt", "Tell me a joke.", "Third one"],
                         [SamplingParams(temperature=1.0, max_tokens=16), params,
                          SamplingParams(temperature=0.5, seed=7, max_tokens=16)])
    assert crowd[1].outputs[0].token_ids == alone
    unseeded = {tuple(o.outputs[0].token_ids) for o in
                llm.generate(["Tell me a joke."] * 4, SamplingParams(temperature=1.0, max_tokens=16))}
    assert len(unseeded) > 1


def test_n_and_logprobs(llm):
    out = llm.generate("The sky is", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8,
                                                    logprobs=3))[0]
    assert [c.index for c in out.outputs] == [0, 1]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for lp, tok in zip(c.logprobs, c.token_ids):
            assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 3
            assert lp.top[0][1] >= lp.logprob - 1e-6
    greedy = llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=4, logprobs=1))[0]
    for lp in greedy.outputs[0].logprobs:  # greedy picks the top token
        assert lp.top[0][0] == lp.token_id


def test_penalties_change_greedy_output(llm):
    prompt = "Repeat after me: la la la la la la"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].token_ids
    penal = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, frequency_penalty=2.0,
                                                presence_penalty=1.0, repetition_penalty=1.3))
    assert penal[0].outputs[0].token_ids != plain


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 50}, "logprobs"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_fail_before_scheduling(llm):
    engine = llm.engine
    ok = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([""], ok)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", [999999999]], ok)  # the first prompt must not run either
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate("word " * 3000, ok)
    assert not engine.has_unfinished_requests() and engine.stats.num_waiting == 0


def test_unknown_model_path():
    from specserve import LLM

    with pytest.raises(ValueError, match="model"):
        LLM("/nonexistent/model/dir")


def test_dummy_weights_and_model_dir(tiny_model_dir, make_llm):
    real = make_llm(str(tiny_model_dir))
    dummy = make_llm(str(tiny_model_dir), load_format="dummy")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = real.generate("hello", params)[0].outputs[0].token_ids
    b = dummy.generate("hello", params)[0].outputs[0].token_ids
    assert len(a) == len(b) == 8 and a != b
