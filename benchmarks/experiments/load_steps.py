"""Where the time of a `bench load` level goes: its closed loop, step by step.

Runs `specserve bench load`'s closed loop (same prompts, same request list, prefix caching off,
greedy) for plain decoding and one speculative config at one concurrency, and splits every
step into: mixed (a prefill chunk beside decodes), plain (decode only, no drafts), spec
(decode only, with drafts) and tail (every step after the last one with a full batch). Per
class: steps, seconds, output tokens and tokens/s; per run: the median rows of the
speculative steps at the full batch.

    python benchmarks/experiments/load_steps.py [--concurrency 16] [--requests 32] [--config '{"method": "ngram"}']
        [--split heldout] [--dtype auto] [--repeats 1] [--off]

--off forces speculation off in the speculative engine (its machinery's cost when idle).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def logged_loop(engine, prompt_ids, concurrency: int, params, tag: str,
                after: list[int | None] | None = None) -> tuple[object, list[dict]]:
    """closed_loop with a record per step: batch, decode only, drafts, seconds, tokens emitted."""
    from specserve.bench.load import closed_loop

    steps: list[dict] = []
    execute, step = engine.runner.execute, engine.step
    current: dict = {}

    def logged_execute(sched, *args):
        interval = engine.spec._interval  # the kind of step the decoder chose for this one
        current.update(batch=len(sched), decode=sched.decode_only, drafts=sum(sched.num_drafts),
                       kind=interval[2] if interval else None)
        return execute(sched, *args)

    def logged_step():
        before, start = engine.stats.generation_tokens_total, time.perf_counter()
        outputs = step()
        if current:
            steps.append(dict(current, seconds=time.perf_counter() - start,
                              tokens=engine.stats.generation_tokens_total - before))
            current.clear()
        return outputs

    engine.runner.execute, engine.step = logged_execute, logged_step
    try:
        run = closed_loop(engine, prompt_ids, concurrency, params, tag, after)
    finally:
        engine.runner.execute, engine.step = execute, step
    return run, steps


def summarise(steps: list[dict], concurrency: int) -> dict[str, dict]:
    full = [i for i, s in enumerate(steps) if s["batch"] == concurrency]
    last_full = full[-1] if full else -1
    out: dict[str, dict] = collections.defaultdict(lambda: {"steps": 0, "seconds": 0.0, "tokens": 0})
    for i, s in enumerate(steps):
        kind = ("tail" if i > last_full else ("mixed+drafts" if s["drafts"] else "mixed") if not s["decode"]
                else "spec" if s["drafts"] else "plain")
        out[kind]["steps"] += 1
        out[kind]["seconds"] += s["seconds"]
        out[kind]["tokens"] += s["tokens"]
    return dict(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=None, help="default: bench load's, max(2c, 8)")
    p.add_argument("--config", default='{"method": "ngram"}', help="the speculative engine's config (JSON)")
    p.add_argument("--split", default="heldout")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--off", action="store_true", help="force speculation off in the speculative engine")
    p.add_argument("--dump", default=None, help="write every step's record (JSON) to this file")
    p.add_argument("--workload", choices=["chat_code", "agentic"], default="chat_code",
                   help="bench load's workloads (agentic: a conversation's turns in order, prefix caching on)")
    args = p.parse_args()

    from specserve import LLM, SamplingParams
    from specserve.bench.load import (agentic_prompt_ids, conversation_list, encode, load_prompts, request_list,
                                      warm_up)

    common = {"max_num_seqs": args.concurrency, "max_model_len": args.max_model_len, "dtype": args.dtype,
              "enable_prefix_caching": args.workload == "agentic"}
    engines = {"plain": LLM(speculative_config=None, **common),
               "spec": LLM(speculative_config=json.loads(args.config), **common)}
    if args.off:
        engines["spec"].engine.spec.policy.realized.speculate = lambda batch, fallback=False: 0  # PLAIN
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    after = None
    if args.workload == "agentic":
        turns, _ = agentic_prompt_ids(engines["plain"], args.split, args.max_tokens, args.max_model_len)
        prompt_ids, after = conversation_list(turns, args.concurrency, args.requests)
    else:
        prompt_ids = request_list(encode(engines["plain"], load_prompts(args.split), args.max_tokens,
                                         args.max_model_len), args.concurrency, args.requests)
    warm_up(engines, args.concurrency, params)
    records = {}
    for rep in range(args.repeats):
        for name, llm in engines.items():
            run, steps = logged_loop(llm.engine, prompt_ids, args.concurrency, params, f"{name}-{rep}", after)
            records[f"{name}-{rep}"] = steps
            parts = ", ".join(f"{kind} {v['steps']} steps {v['seconds']:.1f} s {v['tokens']} tok "
                              f"({v['tokens'] / max(v['seconds'], 1e-9):.0f} tok/s)"
                              for kind, v in summarise(steps, args.concurrency).items())
            rows = [s["drafts"] for s in steps if s["drafts"] and s["batch"] == args.concurrency]
            drafts = f"; median drafts per full spec step {statistics.median(rows):.0f}" if rows else ""
            print(f"{name:<5} run {rep + 1}: {len(prompt_ids)} requests, {run.tokens_per_s:.1f} tok/s in "
                  f"{run.seconds:.1f} s: {parts}{drafts}", flush=True)
    if args.dump:
        Path(args.dump).write_text(json.dumps(records))


if __name__ == "__main__":
    main()
