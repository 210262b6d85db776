"""Greedy rows' LM head (cpu_linear.ArgmaxHead) against the full float32 head, side by side.

1. The head alone, on the default model's own final hidden states (greedy decoding of
   held-out `bench load` prompts): milliseconds per call by number of rows, full head / int8
   product alone / ArgmaxHead, best of --repeats, and the blocks of 64 columns it computed
   exactly a row.
2. Plain greedy decoding of the default model, two engines (one with its argmax head taken
   away), the same prompts at each batch size, the engines' runs alternated: decode tokens/s
   (prefill left out) and whether their tokens agree.

    python benchmarks/experiments/argmax_head.py [--rows 1 2 4 8 16 64] [--batch 1 8 16 64]
        [--max-tokens 96] [--rounds 7] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def prompts_of(llm, n: int) -> list[list[int]]:
    from specserve.bench.load import encode, load_prompts

    texts = load_prompts("heldout")
    return encode(llm, [texts[i % len(texts)] for i in range(n)], 128, 4096)


def head_alone(llm, rows_list: list[int], repeats: int) -> None:
    import torch

    from specserve import SamplingParams

    model = llm.engine.runner.model
    seen = []
    compute = model.compute_logits
    model.compute_logits = lambda h, a=None: (seen.append(h.detach().clone()), compute(h, a))[1]
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts_of(llm, 12)],
                     SamplingParams(temperature=0, max_tokens=48))
    finally:
        model.compute_logits = compute
    hidden = torch.cat([h.reshape(-1, h.shape[-1]) for h in seen])
    full, fast = model.lm_head_kernel, model.argmax_head
    assert torch.equal(full(hidden).argmax(-1), fast(hidden).argmax(-1))
    print(f"the head alone ({len(hidden)} hidden states of the default model; argmax identical):")
    for rows in rows_list:
        x = hidden[:rows].contiguous()
        best = {"full": float("inf"), "int8 product": float("inf"), "argmax head": float("inf")}
        blocks = fast.exact_blocks
        for _ in range(repeats):
            for name, fn in (("full", full), ("int8 product", fast.approx), ("argmax head", fast)):
                fn(x)
                start = time.perf_counter()
                fn(x)
                best[name] = min(best[name], time.perf_counter() - start)
        exact = (fast.exact_blocks - blocks) / (2 * repeats * rows)
        print(f"  rows {rows:>3}: " + "  ".join(f"{k} {1e3 * v:6.2f} ms" for k, v in best.items())
              + f"  {best['full'] / best['argmax head']:.2f}x, {exact:.1f} blocks exact a row", flush=True)


def decode(fast, full, batches: list[int], max_tokens: int, rounds: int) -> None:
    from specserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    print("plain greedy decoding, decode tokens/s (medians over the rounds, each round both engines in turn):")
    for batch in batches:
        prompts = [{"prompt_token_ids": p} for p in prompts_of(full, batch)]
        tps = {"argmax head": [], "full head": []}
        tokens = {}
        for r in range(rounds):
            order = [("argmax head", fast), ("full head", full)]
            for name, llm in order if r % 2 == 0 else order[::-1]:
                outs = llm.generate(prompts, params)
                start, end = max(o.first_token_time for o in outs), max(o.finished_time for o in outs)
                tps[name].append(sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (end - start))
                tokens.setdefault(name, []).append([o.outputs[0].token_ids for o in outs])
        same = tokens["argmax head"] == tokens["full head"]
        a, b = statistics.median(tps["argmax head"]), statistics.median(tps["full head"])
        ratios = [x / y for x, y in zip(tps["argmax head"], tps["full head"])]
        print(f"  batch {batch:>3}: argmax head {a:6.1f}, full head {b:6.1f} tok/s; a round's ratio: median "
              f"{statistics.median(ratios):.2f}x ({' / '.join(f'{r:.2f}' for r in ratios)}); same tokens: {same}",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8, 16, 64])
    p.add_argument("--batch", type=int, nargs="*", default=[1, 8, 16, 64])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()

    from specserve import LLM

    fast = LLM(None, max_model_len=4096, speculative_config=None)
    if fast.engine.runner.model.argmax_head is None:
        sys.exit("argmax_head: this model or machine has no argmax head (a float32 CPU target with a Q8_0 LM head)")
    if args.rows:
        head_alone(fast, args.rows, args.repeats)
    if args.batch:
        full = LLM(None, max_model_len=4096, speculative_config=None)
        full.engine.runner.model.argmax_head = None
        decode(fast, full, args.batch, args.max_tokens, args.rounds)


if __name__ == "__main__":
    main()
