"""Our float32 linear kernel (specserve/kernels/cpu/cpu_linear.c) against torch's GEMM on this CPU.

1. The weights of one decode step of the default model's shapes (30 layers of fused QKV,
   output, fused gate-up and down projections, then the 49k-row LM head), by number of rows:
   milliseconds per step's products for torch (F.linear; the LM head as the engine does it,
   through a transposed copy), for ours over float32 weights, for ours over the same
   products as GGUF blocks (Q4_1 layers, Q8_0 head: what the default model is), where AVX-512
   takes 13-28 rows straight from the blocks the same blocks through the chunk path AVX2 takes
   there ("blocks_chunked"), for the same blocks with int8 activations ("gguf", `--quantization
   gguf`: a8_linear.c), and, on a CPU with native bfloat16, for torch in bfloat16; side by
   side, best of --repeats.
2. Plain decoding of the default model end to end, engines side by side: float32 through
   torch's GEMM ("torch"), through our kernel over float32 weights ("ours"), through our
   kernel over the GGUF blocks ("blocks", the default), with int8 activations against them
   ("gguf"), and bfloat16 where native (start-up choices overridden); greedy, the same
   prompts, runs rotated; median tok/s per engine and whether its tokens agree with "ours"
   (blocks must: the same products bit for bit; torch, gguf and bfloat16 need not, they
   round otherwise; each engine is lossless against itself).

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

    from specserve.kernels.cpu import cpu_linear
    from specserve.kernels.cpu.cpu_linear import PackedFloat32, pack_a8, pack_float32
    from specserve.model.runner import cpu_has_native_bf16

    torch.manual_seed(0)
    hidden, inter, layers, vocab = 576, 1536, 30, 49152
    shapes = [(960, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    weights = [gguf_like("q4_1", n, k) for _ in range(layers) for n, k in shapes]
    head = gguf_like("q8_0", vocab, hidden)
    head_t = head.t().contiguous()
    packed = [PackedFloat32(w, None) for w in weights] + [PackedFloat32(head, None)]
    blocks = [pack_float32(w, None) for w in weights] + [pack_float32(head, None)]
    assert {b.format for b in blocks} == {"q4_1", "q8_0"}
    gguf = [pack_a8(w, None) for w in weights + [head]] if cpu_linear.a8_available() else []
    bf16 = [w.bfloat16() for w in weights + [head]] if cpu_has_native_bf16() else []
    out = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in (hidden, inter)}
        xs16 = {k: x.bfloat16() for k, x in xs.items()}

        def torch_step():
            for w in weights:
                F.linear(xs[w.shape[1]], w)
            xs[hidden] @ head_t

        def kernel_step(layers):
            return lambda: [p(xs[p.in_features]) for p in layers]

        def bf16_step():
            for w in bf16:
                F.linear(xs16[w.shape[1]], w)

        sides = {"torch": torch_step, "ours": kernel_step(packed), "blocks": kernel_step(blocks)}
        if 12 < rows <= cpu_linear.direct_rows():
            sides["blocks_chunked"] = chunked(kernel_step(blocks))
        if gguf:
            sides["gguf"] = kernel_step(gguf)
        if bf16:
            sides["bf16"] = bf16_step
        best = dict.fromkeys(sides, float("inf"))
        for _ in range(repeats):
            for name, fn in sides.items():
                fn()
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
        row = {"rows": rows, **{f"{name}_ms": 1e3 * t for name, t in best.items()},
               "speedup": best["torch"] / best["ours"], "blocks_speedup": best["torch"] / best["blocks"]}
        print(f"rows {rows:>3}: " + "  ".join(f"{name} {1e3 * t:7.1f} ms" for name, t in best.items())
              + f"  ours {row['speedup']:.2f}x, blocks {row['blocks_speedup']:.2f}x torch", flush=True)
        out.append(row)
    return out


def chunked(step):
    """step with the block formats' chunk path from 13 rows on (as with AVX2), where AVX-512
    takes them straight from the blocks up to cpu_linear.direct_rows() rows: the same bits."""
    from specserve.kernels.cpu import cpu_linear

    def run():
        cpu_linear.direct_rows(12)
        try:
            step()
        finally:
            cpu_linear.direct_rows(0)  # the default: as many rows as the tiles take
    return run


def gguf_like(fmt: str, n: int, k: int):
    """[n, k] float32 weights as GGUF's dequantization of Q4_1 or Q8_0 blocks gives them."""
    import torch

    d = (torch.rand(n, k // 32) * 0.01).half().float()
    if fmt == "q4_1":
        m = (-torch.rand(n, k // 32) * 0.05).half().float()
        q = torch.randint(0, 16, (n, k // 32, 32)).float()
        q[..., 0], q[..., 1] = 0, 15
        return (d[..., None] * q + m[..., None]).reshape(n, k)
    q = torch.randint(-127, 128, (n, k // 32, 32)).float()
    q[..., 0] = 127
    return (d[..., None] * q).reshape(n, k)


def decode(batches: list[int], max_tokens: int, repeats: int) -> list[dict]:
    import specserve.kernels.cpu.cpu_linear as cpu_linear
    import specserve.model.quant as quant
    from specserve import LLM, SamplingParams
    from specserve.model.runner import cpu_has_native_bf16

    engines = {}
    real = quant.f32_kernel_pays, cpu_linear.pack_blocks
    for name, pays, blocks in (("torch", False, False), ("ours", True, False), ("blocks", True, True)):
        quant.f32_kernel_pays = lambda hidden, intermediate, pays=pays: pays
        if not blocks:
            cpu_linear.pack_blocks = lambda weight: None
        try:
            engines[name] = LLM(None, dtype="float32", speculative_config=None)
        finally:
            quant.f32_kernel_pays, cpu_linear.pack_blocks = real
    if cpu_linear.a8_available():
        engines["gguf"] = LLM(None, quantization="gguf", speculative_config=None)
    if cpu_has_native_bf16():
        engines["bf16"] = LLM(None, dtype="bfloat16", speculative_config=None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    names = list(engines)
    out = []
    for batch in batches:
        prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(batch)]
        rates: dict[str, list[float]] = {name: [] for name in names}
        tokens = {}
        for r in range(1 + repeats):  # the first round warms up
            for name in names[r % len(names):] + names[:r % len(names)]:
                start = time.perf_counter()
                res = engines[name].generate(prompts, params)
                seconds = time.perf_counter() - start
                tokens[name] = [o.outputs[0].token_ids for o in res]
                if r:
                    rates[name].append(sum(len(t) for t in tokens[name]) / seconds)
        row = {"batch": batch, **{f"{name}_tok_s": statistics.median(rates[name]) for name in names},
               **{f"{name}_same_tokens": tokens[name] == tokens["ours"] for name in names if name != "ours"}}
        row["speedup"] = row["ours_tok_s"] / row["torch_tok_s"]
        print(f"batch {batch:>3}: " + "  ".join(f"{name} {row[f'{name}_tok_s']:6.1f} tok/s" for name in names)
              + "  same tokens as ours: " + ", ".join(f"{name} {row[f'{name}_same_tokens']}"
                                                      for name in names if name != "ours"), flush=True)
        out.append(row)
    return out


def plot(result: dict, path: str) -> None:
    """Two panels: a step's products (ms) by rows, and plain decoding tok/s by batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    rows = [r["rows"] for r in result["products"]]
    for side in [k[:-3] for k in result["products"][0] if k.endswith("_ms")]:
        a.plot(rows, [r[f"{side}_ms"] for r in result["products"]], marker="o", label=side)
    a.set(xscale="log", xlabel="rows per product", ylabel="ms per decode step's products",
          title="default model's shapes")
    a.set_xticks(rows, [str(r) for r in rows])
    batches = [r["batch"] for r in result["decode"]]
    sides = [k[:-6] for k in result["decode"][0] if k.endswith("_tok_s")]
    width = 0.8 / len(sides)
    for i, side in enumerate(sides):
        b.bar([j + (i - (len(sides) - 1) / 2) * width for j in range(len(batches))],
              [r[f"{side}_tok_s"] for r in result["decode"]], width, label=side)
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
    from specserve.kernels.cpu import cpu_linear

    if not cpu_linear.available():
        print(f"our linear kernel cannot run here: {cpu_linear.why_unavailable()}")
        return
    print("one decode step's products of the default model's shapes:")
    result = {"products": products(args.rows, args.repeats)}
    print("plain decoding of the default model, greedy:")
    result["decode"] = decode(args.batch, args.max_tokens, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
