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


def turns(args):
    """Each conversation's message lists as its turns are sent; replies are filled in later."""
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
    from specserve.spec_decode.cost_model import PLAIN

    engines = {"plain": LLM(None, max_model_len=4096, speculative_config=None)}
    for arm in ("not judged", "judged"):
        engines[arm] = LLM(None, max_model_len=4096, speculative_config={"method": args.method})
    engines["judged"].engine.spec.policy.realized.free = frozenset()  # as every batch size is judged
    kinds = {arm: collections.Counter() for arm in ("not judged", "judged")}
    for arm, counter in kinds.items():
        realized = engines[arm].engine.spec.policy.realized
        speculate = realized.speculate
        realized.speculate = lambda b, f=False, s=speculate, c=counter: (k := s(b, f), c.update([k]))[0]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    room = 4096 - args.max_tokens - 8
    tokens, seconds, mismatches = (collections.Counter() for _ in range(3))
    template, tokenizer = engines["plain"].apply_chat_template, engines["plain"].engine.tokenizer
    for conv in turns(args):
        messages = [{"role": "system", "content": conv["system"]}] if conv.get("system") else []
        for turn in conv["turns"]:
            messages.append({"role": "user", "content": turn})
            ids = template(messages)[-room:]
            outs = {}
            for name, llm in engines.items():
                r = llm.generate({"prompt_token_ids": ids}, params)[0]
                outs[name] = r.outputs[0].token_ids
                tokens[name] += len(outs[name]) - 1
                seconds[name] += r.finished_time - r.first_token_time
                mismatches[name] += outs[name] != outs["plain"]
            messages.append({"role": "assistant", "content": tokenizer.decode(outs["plain"], skip_special_tokens=True)})
    plain = tokens["plain"] / seconds["plain"]
    print(f"{args.method}, {args.workload} ({args.split if args.workload == 'agentic' else f'skip {args.skip}'}); "
          f"plain {plain:.1f} tok/s")
    for arm in kinds:
        rate = tokens[arm] / seconds[arm]
        steps = sum(kinds[arm].values())
        print(f"  {arm:>10}: {rate / plain:.3f}x plain, {kinds[arm][PLAIN]} of {steps} steps plain, "
              f"{mismatches[arm]} mismatches")


if __name__ == "__main__":
    main()
