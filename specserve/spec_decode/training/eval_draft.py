"""Measure a draft head's greedy acceptance on the default model through the engine: mean
tokens emitted per verify step (accepted drafts + 1) with every drafted node verified
(`"adaptive": false`), and the wall time against plain greedy decoding of the same prompts
(output checked equal).

    python -m specserve.spec_decode.training.eval_draft [--method eagle|medusa] [--head DIR ...] \\
        [--m 16 --depth 5 --topk 4] [--prompts own|heldout|dev]

The prompts are our own, neither Spec-Bench nor the training templates: eight written for this
check (`own`), or a split of `specserve bench load`'s 48 chat and code prompts (`heldout`: 24
never used for tuning). Several heads are measured in one run against one plain reference.
"""

from __future__ import annotations

import argparse
import time

PROMPTS = [
    "My grandmother keeps asking how email works. Can you explain it simply?",
    "Write a short poem about a cat sleeping in a sunny window.",
    "What are three good habits for staying focused while studying?",
    "Write a Python function that returns the sum of the even numbers in a list.",
    "Tell me a bedtime story about a brave little turtle.",
    "Why do onions make people cry?",
    "Give me a simple recipe for pancakes.",
    "Explain the difference between a virus and a bacterium.",
]


def run(llm, prompts: list[str], num_tokens: int) -> tuple[list[list[int]], float, float]:
    """-> (greedy outputs, tokens per verify step, seconds)."""
    from specserve import SamplingParams

    stats = llm.engine.stats
    drafts, accepted = stats.spec_num_drafts, stats.spec_num_accepted_tokens
    start = time.time()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True))
    elapsed = time.time() - start
    steps = stats.spec_num_drafts - drafts
    per_step = 1 + (stats.spec_num_accepted_tokens - accepted) / steps if steps else 1.0
    return [o.outputs[0].token_ids for o in outs], per_step, elapsed


def main(argv: list[str] | None = None) -> None:
    from specserve import LLM
    from specserve.bench.load import load_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", choices=["eagle", "medusa"], default="eagle")
    p.add_argument("--head", nargs="+", default=[None],
                   help="head directories, each measured in turn ('shipped': eagle's shipped head, the default)")
    p.add_argument("--m", type=int, nargs="+", default=[16])
    p.add_argument("--depth", type=int, default=5, help="eagle only")
    p.add_argument("--topk", type=int, default=4, help="eagle only")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--prompts", choices=["own", "heldout", "dev"], default="own",
                   help="own: eight prompts written for this check; heldout / dev: that split of "
                        "bench load's prompts")
    p.add_argument("--num-prompts", type=int, default=None, help="the first N of them")
    args = p.parse_args(argv)
    heads = [None if h in (None, "shipped") else h for h in args.head]
    if args.method == "medusa" and None in heads:
        p.error("--method medusa needs --head (no Medusa head is shipped)")
    prompts = PROMPTS if args.prompts == "own" else [r["prompt"] for r in load_prompts(args.prompts)]
    prompts = prompts[:args.num_prompts]
    ref, _, t_plain = run(LLM(max_model_len=2048, speculative_config=None), prompts, args.tokens)
    print(f"plain greedy: {t_plain:.1f} s for {len(prompts)} x {args.tokens} tokens", flush=True)
    for head in heads:
        for m in args.m:
            config = {"method": args.method, "num_speculative_tokens": m, "adaptive": False, "lookup_branch": 0}
            if head:
                config["model"] = head
            if args.method == "eagle":
                config.update(depth=args.depth, topk=args.topk)
            out, per_step, t = run(LLM(max_model_len=2048, speculative_config=config), prompts, args.tokens)
            shape = f"m={m} depth={args.depth} topk={args.topk}" if args.method == "eagle" else f"m={m}"
            print(f"{args.method} [{head or 'shipped'}] {shape}: {per_step:.2f} tokens/step, {t:.1f} s, "
                  f"equal to plain: {out == ref}", flush=True)


if __name__ == "__main__":
    main()
