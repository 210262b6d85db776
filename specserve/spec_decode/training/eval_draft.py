"""Measure a draft head's greedy acceptance on the default model with the hand-written tree
loop (specserve.spec_decode.tree): mean tokens emitted per verify step (accepted drafts + 1), and the
wall time against plain greedy decoding of the same prompts (output checked equal).

    python -m specserve.spec_decode.training.eval_draft [--method eagle|medusa] [--head DIR] [--m 16 --depth 5 --topk 4]

The prompts are our own, written for this check: neither Spec-Bench nor the training templates.
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


class _NoDrafts:
    def observe(self, req, start, hidden) -> None:
        pass

    def propose(self, reqs, max_drafts):
        return [None] * len(reqs)


def run_loop(runner, kv, tok, proposer, prompts: list[str], num_tokens: int, max_drafts: int):
    from specserve.request import Request, SamplingParams
    from specserve.spec_decode.tree import prefill_step, tree_spec_step

    reqs = []
    for i, p in enumerate(prompts):
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        reqs.append(Request(str(i), list(ids), SamplingParams(temperature=0.0), set(), 0))
    prefill_step(runner, kv, reqs, proposer)
    start, steps = time.time(), 0
    while min(r.num_output_tokens for r in reqs) < num_tokens:
        tree_spec_step(runner, kv, reqs, proposer, max_drafts)
        steps += 1
    elapsed = time.time() - start
    out = [r.output_token_ids[:num_tokens] for r in reqs]
    per_step = sum(r.num_output_tokens - 1 for r in reqs) / (steps * len(reqs))
    for r in reqs:
        kv.free(r)
    return out, per_step, elapsed


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from specserve.config import DEFAULT_MODEL, CacheConfig, ModelConfig
    from specserve.kv_cache.manager import KVCacheManager
    from specserve.model.arch import ModelArch
    from specserve.model.loader import resolve_model_dir
    from specserve.model.runner import ModelRunner

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", choices=["eagle", "medusa"], default="eagle")
    p.add_argument("--head", default=None, help="head directory (eagle: default the shipped head)")
    p.add_argument("--m", type=int, nargs="+", default=[16])
    p.add_argument("--depth", type=int, default=5, help="eagle only")
    p.add_argument("--topk", type=int, default=4, help="eagle only")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    args = p.parse_args(argv)
    if args.method == "medusa" and not args.head:
        p.error("--method medusa needs --head (no Medusa head is shipped)")
    model_dir = resolve_model_dir(DEFAULT_MODEL)
    arch = ModelArch.from_dir(model_dir)
    runner = ModelRunner(model_dir, arch, ModelConfig(), CacheConfig(num_blocks=512), 2048)
    kv = KVCacheManager(512, 16, enable_prefix_caching=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = PROMPTS[:args.num_prompts]
    ref, _, t_plain = run_loop(runner, kv, tok, _NoDrafts(), prompts, args.tokens, 0)
    print(f"plain greedy: {t_plain:.1f} s for {len(prompts)} x {args.tokens} tokens", flush=True)
    for m in args.m:
        if args.method == "eagle":
            from specserve.spec_decode.eagle import EagleProposer

            prop = EagleProposer(runner.model, args.head, m, args.depth, args.topk)
        else:
            from specserve.spec_decode.medusa import MedusaProposer

            prop = MedusaProposer(runner.model, args.head, m)
        out, per_step, t = run_loop(runner, kv, tok, prop, prompts, args.tokens, m)
        shape = f"m={m} depth={args.depth} topk={args.topk}" if args.method == "eagle" else f"m={m}"
        print(f"{args.method} {shape}: {per_step:.2f} tokens/step, "
              f"{t:.1f} s, equal to plain: {out == ref}", flush=True)


if __name__ == "__main__":
    main()
