"""Where a `bench load` step's milliseconds go, plain decoding beside one speculative config:
the target forward, sampling and verification, drafting (`propose`, the decoder's judge and
policy included), scheduling and the rest of the engine step; and the step kinds the decoder
chose. Both engines' steps interleaved over bench load's closed loop, held-out prompts, prefix
caching off, greedy.

    python benchmarks/experiments/load_step_split.py [--concurrency 4] [--requests 24]
        [--method ngram|eagle|suffix]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PARTS = ("step", "forward", "verify", "propose", "schedule")


def timed(obj, name: str, totals: dict, key: str) -> None:
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        totals[key] += time.perf_counter() - start
        totals[key + " calls"] += 1
        return out
    setattr(obj, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--method", default="ngram", choices=["ngram", "eagle", "suffix"])
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    from specserve import LLM, SamplingParams
    from specserve.bench.load import ClosedLoop, encode, interleaved, load_prompts, request_list, warm_up

    c = args.concurrency
    common = dict(max_num_seqs=c, max_model_len=2048, enable_prefix_caching=False)
    engines = {"plain": LLM(None, speculative_config=None, **common),
               args.method: LLM(None, speculative_config={"method": args.method}, **common)}
    totals = {m: collections.defaultdict(float) for m in engines}
    for m, llm in engines.items():
        e = llm.engine
        for obj, name, key in ((e.runner, "execute", "forward"), (e.spec, "sample_and_verify", "verify"),
                               (e.spec, "propose", "propose"), (e.scheduler, "schedule", "schedule"),
                               (e, "step", "step")):
            timed(obj, name, totals[m], key)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    ids = encode(engines["plain"], load_prompts("heldout"), args.max_tokens, 2048)
    warm_up(engines, c, params)
    for t in totals.values():
        t.clear()
    loops = [ClosedLoop(engines[m].engine, request_list(ids, c, args.requests), c, params, m) for m in engines]
    for m, run in zip(engines, interleaved(loops)):
        t, steps = totals[m], totals[m]["step calls"]
        parts = {k: 1e3 * t[k] / steps for k in PARTS}
        parts["rest"] = parts["step"] - sum(parts[k] for k in PARTS[1:])
        print(f"{m}: {run.tokens_per_s:.1f} tok/s, {steps:.0f} steps, {run.tokens / steps:.2f} tokens a step; "
              "ms a step: " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
        s = engines[m].engine.stats
        if m != "plain":
            print(f"   step kinds: drafting {s.spec_steps_drafting}, lookup only {s.spec_steps_lookup_only}, "
                  f"plain {s.spec_steps_plain}; drafts verified {s.spec_num_drafts}, "
                  f"tokens accepted {s.spec_num_accepted_tokens}")


if __name__ == "__main__":
    main()
