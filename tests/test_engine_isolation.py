"""A step that raises fails only the request it can be traced to (Engine._recover): the others
keep exactly the tokens they get without it, and every KV block comes back.

Faults are injected into the real engine (the default model's tokenizer, a tiny random
model): a step raises whenever the poisoned request is in it, in the forward, while drafting,
or only once the request has produced a few tokens.
"""

from __future__ import annotations

import pytest

from specserve import SamplingParams
from specserve.engine import MAX_STEP_FAILURES, Engine

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37] * (i + 1) + [100 + i] for i in range(7)]


@pytest.fixture(scope="module")
def llm(make_llm, tiny_model_dir):
    return make_llm(str(tiny_model_dir), max_model_len=512, speculative_config={"method": "ngram"},
                    num_blocks=96, block_size=16)


def run(engine: Engine, prompts: list[list[int]], max_tokens: int = 24) -> dict[str, object]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


@pytest.fixture(scope="module")
def reference(llm):
    return {rid: out.outputs[0].token_ids for rid, out in run(llm.engine, PROMPTS).items()}


def poison(monkeypatch, engine: Engine, where: str, victim: str, after_tokens: int = 0) -> list[int]:
    """Make steps raise whenever `victim` is in them (once it has `after_tokens` outputs)."""
    raised = []

    def bad(reqs) -> bool:
        return any(r.request_id == victim and r.num_output_tokens >= after_tokens for r in reqs)

    if where == "forward":
        real = engine.runner.execute

        def execute(sched, *args, **kwargs):
            if bad(sched.requests):
                raised.append(1)
                raise RuntimeError("injected fault in the forward")
            return real(sched, *args, **kwargs)

        monkeypatch.setattr(engine.runner, "execute", execute)
    else:
        real_propose = engine.spec.propose

        def propose(running, *args, **kwargs):
            if bad(running):
                raised.append(1)
                raise IndexError("injected fault while drafting")
            return real_propose(running, *args, **kwargs)

        monkeypatch.setattr(engine.spec, "propose", propose)
    return raised


@pytest.mark.parametrize("where, after", [("forward", 0), ("propose", 0), ("forward", 5)])
def test_only_the_faulty_request_fails(llm, reference, monkeypatch, where, after):
    engine = llm.engine
    raised = poison(monkeypatch, engine, where, "r3", after)
    finals = run(engine, PROMPTS)
    assert raised, "the fault never fired"
    bad = finals.pop("r3")
    assert bad.outputs[0].finish_reason == "error"
    assert bad.error and "r3" in bad.error and "injected" not in bad.error
    for rid, out in finals.items():
        assert out.outputs[0].finish_reason == "length", rid
        assert out.outputs[0].token_ids == reference[rid], rid
    assert engine.stats.num_failed_steps >= 1
    kv = engine.kv
    assert kv.num_free_blocks == kv.num_total_blocks  # (the autouse fixture checks it too)


def test_a_fault_that_is_not_any_one_requests_fails_them_in_the_end(llm, monkeypatch):
    """Every step raises: tracing ends with each request failed, never a loop."""
    engine = llm.engine

    def execute(*args, **kwargs):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(engine.runner, "execute", execute)
    finals = run(engine, PROMPTS[:4])
    assert {out.outputs[0].finish_reason for out in finals.values()} == {"error"}
    assert len(finals) == 4
    assert MAX_STEP_FAILURES >= 2
