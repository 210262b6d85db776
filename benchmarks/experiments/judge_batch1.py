"""Speculation without drafting cost (prompt lookup, suffix decoding) at batch 1, with and
without Realized's whole-step verdict (`Realized.free`): plain decoding and both arms of one
method run each turn back to back, greedy, in one process; decode tokens/s over plain, the
outputs compared with plain decoding's, and the step kinds each arm chose.

    python benchmarks/experiments/judge_batch1.py [--method suffix|ngram] [--workload agentic|spec_bench]
        [--split heldout] [--skip 5] [--limit 3]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def conversations(args):
    """The workload as conversations (a Spec-Bench question: one of a single turn)."""
    from specserve.bench.spec import CATEGORIES, load_conversations, load_prompts

    if args.workload == "spec_bench":
        return [{"turns": [t]} for _, t in load_prompts(CATEGORIES, args.limit, False, args.skip)]
    return load_conversations(args.split)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=["suffix", "ngram"], default="suffix")
    parser.add_argument("--workload", choices=["agentic", "spec_bench"], default="agentic")
    parser.add_argument("--split", default="heldout", help="agentic: dev, heldout or all")
    parser.add_argument("--skip", type=int, default=5, help="spec_bench: questions skipped per category")
    parser.add_argument("--limit", type=int, default=3, help="spec_bench: questions per category")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    from specserve import LLM, SamplingParams
    from specserve.bench.spec import Tally, run_conversations
    from specserve.spec_decode.cost_model import PLAIN

    arms = ("not judged", "judged")
    engines = {"none": LLM(None, max_model_len=4096, speculative_config=None)}
    for arm in arms:
        engines[arm] = LLM(None, max_model_len=4096, speculative_config={"method": args.method})
    engines["judged"].engine.spec.policy.realized.free = frozenset()  # as every batch size is judged
    kinds = {arm: collections.Counter() for arm in arms}
    for arm, counter in kinds.items():
        realized = engines[arm].engine.spec.policy.realized
        speculate = realized.speculate
        realized.speculate = lambda b, f=False, s=speculate, c=counter: (k := s(b, f), c.update([k]))[0]
    tallies = {name: Tally() for name in engines}
    run_conversations(engines, conversations(args), lambda conv: tallies,
                      SamplingParams(temperature=0, max_tokens=args.max_tokens), 4096 - args.max_tokens - 8)
    plain = tallies["none"].decode_tps
    print(f"{args.method}, {args.workload} ({args.split if args.workload == 'agentic' else f'skip {args.skip}'}); "
          f"plain {plain:.1f} tok/s")
    for arm in arms:
        steps = sum(kinds[arm].values())
        print(f"  {arm:>10}: {tallies[arm].decode_tps / plain:.3f}x plain, {kinds[arm][PLAIN]} of {steps} steps "
              f"plain, {tallies[arm].mismatches} mismatches")


if __name__ == "__main__":
    main()
