"""`specserve bench offline`: specserve against Hugging Face transformers generate().

Both engines load the same weights and decode the same prompts greedily to the same length in
one process, interleaved prompt by prompt, so machine noise hits both alike. Reported:
  * batch 1: tokens/s of each over the prompts one at a time, and the ratio;
  * concurrent: tokens/s of specserve with N requests in flight, against transformers' batch-1
    rate (the number a user would get without a batching server) and against transformers'
    own padded batch of N.
Results: a table on stdout, JSON and a PNG bar chart in --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specserve.config import DTYPE_CHOICES, QUANTIZATION_CHOICES

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about autumn leaves.",
    "def quicksort(arr):",
    "List five uses of a paperclip:",
    "The main causes of the French Revolution were",
    "Describe the water cycle for a ten-year-old.",
    "Give three tips for writing clean Python code.",
    "Once upon a time, a robot learned to paint.",
]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model alias, directory or GGUF (default model)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=4, help="prompts for the batch-1 runs")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES),
                   help="both engines (auto: as `specserve serve` picks)")
    p.add_argument("--quantization", default="none", choices=list(QUANTIZATION_CHOICES),
                   help="specserve's target weights (int8: see `specserve serve --help`)")
    p.add_argument("--no-hf-batch", action="store_true", help="skip transformers' padded batch")
    p.add_argument("--out", default="bench_out/offline")


def _hf_generate(hf, tokenizer, prompts: list[str], max_tokens: int) -> tuple[int, float]:
    import torch

    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                          pad_token_id=tokenizer.pad_token_id or 0)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - enc["input_ids"].shape[1]) * len(prompts), elapsed


def _ours(llm, prompts: list[str], max_tokens: int) -> tuple[int, float]:
    from specserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), elapsed


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from specserve import LLM

    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, quantization=args.quantization)
    tok = llm.get_tokenizer()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir,
                                              dtype=llm.engine.runner.dtype).eval()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_prompts)]
    _ours(llm, prompts[:1], 4)  # warm both up
    _hf_generate(hf, tok, prompts[:1], 4)

    totals = {"ours_b1": [0, 0.0], "hf_b1": [0, 0.0]}
    for prompt in tqdm(prompts, desc="batch 1 (interleaved)"):
        for key, fn in (("ours_b1", lambda: _ours(llm, [prompt], args.max_tokens)),
                        ("hf_b1", lambda: _hf_generate(hf, tok, [prompt], args.max_tokens))):
            n, dt = fn()
            totals[key][0] += n
            totals[key][1] += dt
    many = [PROMPTS[i % len(PROMPTS)] + f" (variant {i})" for i in range(args.concurrency)]
    print(f"[bench] {args.concurrency} concurrent requests ...", flush=True)
    totals["ours_concurrent"] = list(_ours(llm, many, args.max_tokens))
    if not args.no_hf_batch:
        print(f"[bench] transformers padded batch of {args.concurrency} ...", flush=True)
        totals["hf_batch"] = list(_hf_generate(hf, tok, many, args.max_tokens))
    rates = {k: n / dt for k, (n, dt) in totals.items()}
    result = {
        "date": time.strftime("%Y-%m-%d"), "model": llm.engine.model_name,
        "dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
        "quantization": args.quantization,
        "max_tokens": args.max_tokens, "num_prompts": args.num_prompts,
        "concurrency": args.concurrency, "tokens_per_s": rates,
        "ratio_batch1": rates["ours_b1"] / rates["hf_b1"],
        "ratio_concurrent_vs_hf_b1": rates["ours_concurrent"] / rates["hf_b1"],
    }
    if "hf_batch" in rates:
        result["ratio_concurrent_vs_hf_batch"] = rates["ours_concurrent"] / rates["hf_batch"]
    _report(result, Path(args.out))
    return 0


def _report(result: dict, out: Path) -> None:
    r = result["tokens_per_s"]
    print(f"\n{'run':<36}{'tokens/s':>10}")
    labels = {"ours_b1": "specserve, batch 1", "hf_b1": "transformers generate, batch 1",
              "ours_concurrent": f"specserve, {result['concurrency']} concurrent",
              "hf_batch": f"transformers, padded batch {result['concurrency']}"}
    for key, label in labels.items():
        if key in r:
            print(f"{label:<36}{r[key]:>10.1f}")
    print(f"\nbatch 1 ratio (specserve / transformers):            {result['ratio_batch1']:.2f}x")
    print(f"concurrent / transformers batch 1:                    "
          f"{result['ratio_concurrent_vs_hf_b1']:.2f}x")
    if "ratio_concurrent_vs_hf_batch" in result:
        print(f"concurrent / transformers padded batch:               "
              f"{result['ratio_concurrent_vs_hf_batch']:.2f}x")
    out.mkdir(parents=True, exist_ok=True)
    (out / "offline.json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in labels if k in r]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([labels[k] for k in keys], [r[k] for k in keys],
            color=["#1f77b4" if k.startswith("ours") else "#aaaaaa" for k in keys])
    ax.set_xlabel("output tokens / s")
    ax.set_title(f"{result['model']} ({result['dtype']}), {result['max_tokens']} tokens per request")
    fig.tight_layout()
    fig.savefig(out / "offline.png", dpi=120)
    print(f"\nwrote {out / 'offline.json'} and {out / 'offline.png'}")
