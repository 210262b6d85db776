"""What batch invariance costs bfloat16 on this CPU, and what it buys: plain decoding and prompt
lookup, each with PyTorch's products in calls of the measured size (`--batch-invariant`, the
default) and with oneDNN's whole calls (`--no-batch-invariant`), the four engines' steps
interleaved as in `specserve bench load` (held-out chat and code prompts, greedy). Per level:
tok/s, each engine's speed over the invariant plain one, and how many of prompt lookup's
answers differ from its own plain engine's.

    python benchmarks/experiments/bf16_invariance.py [--concurrency 1 16 64] [--requests 32] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--requests", type=int, default=32, help="per level, at least 2 x concurrency")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args()

    from specserve import LLM, SamplingParams
    from specserve.bench.load import encode, load_prompts, request_list, run_level, warm_up

    common = {"dtype": args.dtype, "max_num_seqs": max(args.concurrency), "max_model_len": 2048}
    engines = {f"{name}{tag}": LLM(speculative_config=config, batch_invariant=invariant, **common)
               for name, config in (("plain", None), ("ngram", {"method": "ngram"}))
               for tag, invariant in (("", True), ("-oneDNN", False))}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    prompts = encode(engines["plain"], load_prompts("heldout"), args.max_tokens, 2048)
    warm_up(engines, max(args.concurrency), params)
    for level, c in enumerate(args.concurrency):
        runs = {m: r[0] for m, r in run_level(engines, request_list(prompts, c, max(args.requests, 2 * c)),
                                              c, level, 1, params).items()}
        base = runs["plain"].tokens_per_s
        print(f"{c} in flight: " + ", ".join(f"{m} {r.tokens_per_s:.1f} tok/s ({r.tokens_per_s / base:.3f}x)"
                                             for m, r in runs.items()), flush=True)
        for tag in ("", "-oneDNN"):
            differ = sum(a != b for a, b in zip(runs[f"ngram{tag}"].outputs, runs[f"plain{tag}"].outputs))
            print(f"  ngram{tag} answers differing from plain{tag}'s: {differ} of {len(runs['plain'].outputs)}",
                  flush=True)


if __name__ == "__main__":
    main()
