"""Our float32 linear kernel (specserve/kernels/cpu_linear.c) against torch's GEMM on this CPU.

1. The weights of one decode step of the default model's shapes (30 layers of fused QKV,
   output, fused gate-up and down projections, then the 49k-row LM head), by number of rows:
   milliseconds per step's products for torch (F.linear; the LM head as the engine does it,
   through a transposed copy) and for ours, side by side, best of --repeats.
2. Plain decoding of the default model end to end: one engine whose projections went into our
   kernel and one that kept torch's GEMM (start-up measurement overridden both ways), greedy,
   the same prompts, runs alternated; median tok/s per side and whether the tokens agree (they
   need not: the two sum in different orders; each engine is lossless against itself).

    python benchmarks/cpu_linear.py [--rows 1 2 4 8 16 64] [--batch 1 8 16] [--max-tokens 64]
        [--repeats 3] [--json OUT.json] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["Write a short story about a robot who learns to paint.",
           "Explain how a hash map works, with an example in Python."]


def products(rows_list: list[int], repeats: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from specserve.kernels.cpu_linear import PackedFloat32

    torch.manual_seed(0)
    hidden, inter, layers, vocab = 576, 1536, 30, 49152
    shapes = [(960, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    weights = [torch.randn(n, k) * 0.05 for _ in range(layers) for n, k in shapes]
    head = torch.randn(vocab, hidden) * 0.05
    head_t = head.t().contiguous()
    packed = [PackedFloat32(w, None) for w in weights] + [PackedFloat32(head, None)]
    out = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in (hidden, inter)}

        def torch_step():
            for w in weights:
                F.linear(xs[w.shape[1]], w)
            xs[hidden] @ head_t

        def our_step():
            for p in packed:
                p(xs[p.in_features])

        best = {"torch": float("inf"), "ours": float("inf")}
        for _ in range(repeats):
            for name, fn in (("torch", torch_step), ("ours", our_step)):
                fn()
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
        row = {"rows": rows, "torch_ms": 1e3 * best["torch"], "ours_ms": 1e3 * best["ours"],
               "speedup": best["torch"] / best["ours"]}
        print(f"rows {rows:>3}: torch {row['torch_ms']:7.1f} ms  ours {row['ours_ms']:7.1f} ms  "
              f"{row['speedup']:.2f}x", flush=True)
        out.append(row)
    return out


def decode(batches: list[int], max_tokens: int, repeats: int) -> list[dict]:
    import specserve.model.quant as quant
    from specserve import LLM, SamplingParams

    engines = {}
    for name, pays in (("torch", False), ("ours", True)):
        real = quant.f32_kernel_pays
        quant.f32_kernel_pays = lambda hidden, intermediate, pays=pays: pays
        try:
            engines[name] = LLM(None, dtype="float32")
        finally:
            quant.f32_kernel_pays = real
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = []
    for batch in batches:
        prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(batch)]
        rates: dict[str, list[float]] = {"torch": [], "ours": []}
        tokens = {}
        for r in range(1 + repeats):  # the first round warms up
            for name in (("torch", "ours") if r % 2 else ("ours", "torch")):
                start = time.perf_counter()
                res = engines[name].generate(prompts, params)
                seconds = time.perf_counter() - start
                tokens[name] = [o.outputs[0].token_ids for o in res]
                if r:
                    rates[name].append(sum(len(t) for t in tokens[name]) / seconds)
        row = {"batch": batch, "torch_tok_s": statistics.median(rates["torch"]),
               "ours_tok_s": statistics.median(rates["ours"]), "same_tokens": tokens["torch"] == tokens["ours"]}
        row["speedup"] = row["ours_tok_s"] / row["torch_tok_s"]
        print(f"batch {batch:>3}: torch {row['torch_tok_s']:6.1f} tok/s  ours {row['ours_tok_s']:6.1f} tok/s  "
              f"{row['speedup']:.2f}x  same tokens: {row['same_tokens']}", flush=True)
        out.append(row)
    return out


def plot(result: dict, path: str) -> None:
    """Two panels: a step's products (ms) by rows, and plain decoding tok/s by batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    rows = [r["rows"] for r in result["products"]]
    for side in ("torch", "ours"):
        a.plot(rows, [r[f"{side}_ms"] for r in result["products"]], marker="o", label=side)
    a.set(xscale="log", xlabel="rows per product", ylabel="ms per decode step's products",
          title="default model's shapes, float32")
    a.set_xticks(rows, [str(r) for r in rows])
    batches = [r["batch"] for r in result["decode"]]
    width = 0.38
    for i, side in enumerate(("torch", "ours")):
        b.bar([j + (i - 0.5) * width for j in range(len(batches))], [r[f"{side}_tok_s"] for r in result["decode"]],
              width, label=side)
    b.set_xticks(range(len(batches)), [str(x) for x in batches])
    b.set(xlabel="requests in flight", ylabel="tok/s", title="plain decoding, greedy")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="write a PNG of both parts here")
    args = p.parse_args()
    from specserve.kernels import cpu_linear

    if not cpu_linear.available():
        print(f"our linear kernel cannot run here: {cpu_linear.why_unavailable()}")
        return
    print("one decode step's products of the default model's shapes, float32:")
    result = {"products": products(args.rows, args.repeats)}
    print("plain decoding of the default model, float32, greedy:")
    result["decode"] = decode(args.batch, args.max_tokens, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
