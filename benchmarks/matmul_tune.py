"""Time the batch-invariant linear kernel's constants on a GPU, against cuBLAS.

`--batch-invariant` (bfloat16's default on CUDA) sends every product of the model through
specserve/kernels/triton/matmul.py, whose tiles (BLOCK_M x BLOCK_N outputs, BLOCK_K deep), warps,
pipeline stages and K partition (SPLIT_K) are constants, the same for every batch, so that a
row's bits never depend on the rows beside it. Any constants keep that property; which are
fastest is a property of the GPU. This script times combinations of them on a model's products
(by default a Llama-3-8B layer's four: qkv, o, gate/up, down) at a few row counts against
`F.linear` (cuBLAS), and prints per combination, best first, cuBLAS's time over ours summed
over the products at each row count, and their geometric mean; OUT/matmul_tune.json holds the
per-case figures. Every combination is checked before it is timed: its output near cuBLAS's,
and each row's bits the same in a 1-row, a 16-row and a 64-row call (a combination that breaks
that is reported, never ranked). Changing SPLIT_K or BLOCK_K changes the bits the kernel gives
(the same for every batch, but not the shipped constants' bits).

The default search is a coordinate descent from the shipped constants (one knob at a time, the
best kept, until a round finds nothing better or --budget-s runs out); --search grid times every
combination.

    python benchmarks/matmul_tune.py --out DIR --budget-s 200
    python benchmarks/matmul_tune.py --device cpu --quick        # a smoke run under the interpreter

Set the winner in matmul.py (BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES, SPLIT_K) and run
tests/kernels/triton.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._tune import main as tune_main  # noqa: E402
from benchmarks._tune import search  # noqa: E402

KNOBS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k")
SET = KNOBS[:-1]  # the ones set on the module (split_k goes with each call)
# (name, N, K) of a Llama-3-8B layer's products (hidden 4096, 32 / 8 heads of 128, intermediate 14336)
SHAPES_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-m", type=ints, default=[16, 64])
    p.add_argument("--block-n", type=ints, default=[32, 64, 128])
    p.add_argument("--block-k", type=ints, default=[32, 64, 128])
    p.add_argument("--warps", type=ints, default=[4, 8])
    p.add_argument("--stages", type=ints, default=[2, 3, 4])
    p.add_argument("--split-k", type=ints, default=[256, 512, 1024], help="K partition length")
    p.add_argument("--rows", type=ints, default=[1, 16, 64], help="row counts (requests x rows) timed")
    p.add_argument("--shapes", default=",".join(f"{n}:{N}:{K}" for n, N, K in SHAPES_8B),
                   help="name:N:K of the products, comma-separated")
    p.add_argument("--search", choices=["descent", "grid"], default="descent")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop trying combinations after this long")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes, two knobs of two values (a smoke run)")
    p.add_argument("--out", default="benchmarks/out")
    return p.parse_args(argv)


def _shapes(text: str) -> list[tuple[str, int, int]]:
    out = []
    for item in text.split(","):
        name, n, k = item.split(":")
        out.append((name, int(n), int(k)))
    return out


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def run(args) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from benchmarks.kernels import time_ms
    from specserve.kernels.triton import matmul as mm

    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    if args.quick:
        args.shapes, args.rows = "a:96:160,b:40:320", [1, 3]
        args.block_m, args.block_n, args.block_k, args.warps, args.stages = [64], [32, 64], [64], [4], [2]
        args.split_k = [mm.SPLIT_K]
    shapes = _shapes(args.shapes)
    gen = torch.Generator(device="cpu").manual_seed(0)
    data = {}  # name -> (x [64, K], w [N, K], cuBLAS ms by rows)
    for name, n, k in shapes:
        x = torch.randn(max(64, *args.rows), k, generator=gen).to(dev, dtype)
        w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dev, dtype)
        base = {m: time_ms(lambda x=x[:m], w=w: F.linear(x, w), dev) for m in args.rows}
        data[name] = (x, w, base)
        print(f"[tune] {name} {n} x {k}: cuBLAS " + ", ".join(f"{m} rows {1e3 * t:.1f} us" for m, t in base.items()),
              flush=True)
    saved = {k: getattr(mm, k.upper()) for k in KNOBS}
    knobs = dict(zip(KNOBS, (args.block_m, args.block_n, args.block_k, args.warps, args.stages, args.split_k)))
    results, tried = [], {}
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4

    def ours(x, w, split_k):
        return mm.linear_invariant_triton(x, w, None, split_k=split_k)

    def measure(combo):
        key = tuple(combo[k] for k in KNOBS)
        if key in tried:
            return tried[key]
        row = dict(combo, cases={})
        if combo["split_k"] % combo["block_k"]:
            row["error"] = "skipped: block_k must divide split_k"
        else:
            for k in SET:
                setattr(mm, k.upper(), combo[k])
            try:
                per_rows = {m: [0.0, 0.0] for m in args.rows}  # rows -> [cuBLAS ms, ours ms] over the shapes
                for name, (x, w, base) in data.items():
                    full = ours(x, w, combo["split_k"])
                    err = float((full.float() - F.linear(x, w).float()).abs().max())
                    if not err <= tol * max(1.0, float(full.float().abs().max())):
                        raise ValueError(f"{name}: off by {err:.3g} from cuBLAS")
                    for m in (1, 16):  # a row's bits alone, in 16 rows and in the whole batch
                        if not torch.equal(ours(x[:m], w, combo["split_k"]), full[:m]):
                            raise ValueError(f"{name}: rows of a {m}-row call differ from the same rows "
                                             f"in {x.shape[0]}: not batch-invariant")
                    for m in args.rows:
                        ms = time_ms(lambda x=x[:m], w=w, s=combo["split_k"]: ours(x, w, s), dev)
                        row["cases"][f"{name}:{m}"] = {"us": round(ms * 1e3, 1), "vs_cublas": _sig(base[m] / ms)}
                        per_rows[m][0] += base[m]
                        per_rows[m][1] += ms
                ratios = {m: b / o for m, (b, o) in per_rows.items()}
                row["vs_cublas_by_rows"] = {m: _sig(r) for m, r in ratios.items()}
                row["geomean_vs_cublas"] = _sig(math.exp(sum(map(math.log, ratios.values())) / len(ratios)))
            except Exception as e:  # a combination that does not compile (shared memory, ...) or fails a check
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            finally:
                for k in SET:
                    setattr(mm, k.upper(), saved[k])
        tried[key] = row
        results.append(row)
        print(f"[tune] {len(results)} " + " ".join(f"{k} {combo[k]}" for k in KNOBS) + ": "
              + (row.get("error") or f"geomean {row['geomean_vs_cublas']}x cuBLAS, by rows "
                 + ", ".join(f"{m}: {v}x" for m, v in row["vs_cublas_by_rows"].items())), flush=True)
        return row

    def score(row):
        return row.get("geomean_vs_cublas", 0.0)

    search(knobs, saved, measure, score, args.search, args.budget_s)
    ok = sorted((r for r in results if "error" not in r), key=lambda r: -r["geomean_vs_cublas"])
    print("\nbest first (cuBLAS time / ours over the products; > 1: ours faster)")
    print(" ".join(f"{k:>10s}" for k in KNOBS) + f" {'geomean':>8s} " + " ".join(f"{m:>8d}" for m in args.rows))
    for r in ok[:12]:
        print(" ".join(f"{r[k]:10d}" for k in KNOBS) + f" {r['geomean_vs_cublas']:8.3f} "
              + " ".join(f"{r['vs_cublas_by_rows'][m]:8.3f}" for m in args.rows))
    print(f"(now: {saved})")
    return results


def main(argv=None) -> int:
    return tune_main(parse_args(argv), run, "matmul_tune")

if __name__ == "__main__":
    sys.exit(main())
