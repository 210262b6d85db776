"""Time the Triton paged/tree attention kernel's launch constants on a GPU, against SDPA.

The kernel (specserve/kernels/triton/paged_attention.py) launches with constants fixed for
every step -- the query rows a program holds (BLOCK_M), the keys per partition (PARTITION_SIZE),
and per head size the keys per tile, warps, pipeline stages and the next tile's prefetch
(CONFIG) -- because a row's bits must not depend on the batch it is in. Its launch mode (split
into partials and a reduction, or fused) is a choice of speed only (choose_split); --launch
times it forced either way beside the heuristic's pick. Which values are fastest is a property of the GPU. This
script times combinations of the candidates below on decode cases (one query per request) and
tree cases (a 64-node tree per request), each against PyTorch SDPA on the same data (flash for
decode, a dense mask for trees), and prints per combination the geometric mean of "SDPA time /
ours" over the cases, best first, with the per-case figures in OUT/attention_tune.json.

The default search is a coordinate descent from the shipped constants: each round tries every
other value of one knob at a time, keeping the best so far, until a round finds nothing better
or the time budget (--budget-s) runs out; --search grid times every combination instead.

    python benchmarks/attention_tune.py --out DIR --budget-s 200        # descent (~20 combinations)
    python benchmarks/attention_tune.py --search grid --block-n 32,64 --stages 2,3 --prefetch 0,1
    python benchmarks/attention_tune.py --device cpu --quick            # a smoke run under the interpreter

Set the winner in paged_attention.py (CONFIG, BLOCK_M, PARTITION_SIZE) and run
tests/kernels/triton (the invariance tests hold for any constants).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._tune import main as tune_main  # noqa: E402
from benchmarks._tune import search  # noqa: E402


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-n", type=ints, default=[32, 64, 128], help="keys per tile")
    p.add_argument("--warps", type=ints, default=[4, 8])
    p.add_argument("--stages", type=ints, default=[2, 3])
    p.add_argument("--block-m", type=ints, default=[16, 64], help="query rows per program")
    p.add_argument("--partition", type=ints, default=[128, 256, 512], help="keys per partition")
    p.add_argument("--prefetch", type=ints, default=[0, 1], help="1: load the next K/V tile before the math")
    p.add_argument("--launch", default="auto,split,fused",
                   help="launch modes: auto (choose_split's pick), split or fused forced (the same bits)")
    p.add_argument("--search", choices=["descent", "grid"], default="descent")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop trying combinations after this long")
    p.add_argument("--cases", default="decode:1:1024,decode:1:16384,decode:16:4096,decode:64:16384,"
                                      "tree:1:4096,tree:16:4096",
                   help="kind:requests:context, comma-separated")
    p.add_argument("--tree-size", type=int, default=64)
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="two knobs of two values, tiny shapes (a smoke run)")
    p.add_argument("--out", default="benchmarks/out")
    return p.parse_args(argv)


def _cases(args):
    out = []
    for text in args.cases.split(","):
        kind, b, ctx = text.split(":")
        out.append((kind, int(b), int(ctx)))
    return out


def run(args) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.kernels import make_case, random_tree, time_ms
    from specserve.kernels.triton import paged_attention as pa
    from specserve.kernels.triton.tree_attention import num_mask_words, tree_ancestors, tree_mask_from_parents

    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    if args.quick:
        args.num_q_heads, args.num_kv_heads, args.head_dim, args.tree_size = 4, 2, 64, 8
        args.cases = "decode:1:300,tree:1:300"
        args.block_n, args.warps, args.stages, args.block_m = [64], [4], [2], [16, 64]
        args.partition = [pa.PARTITION_SIZE]
        args.prefetch, args.launch = [0, 1], "auto"
    D = args.head_dim

    def timed(fn):
        return time_ms(fn, dev, warmup=10, rep=50, cpu_reps=2)

    gen = torch.Generator().manual_seed(0)
    launch = {"split": None}  # the launch mode ours() forces (None: choose_split's pick)
    data = []  # (case, ours(fn), baseline ms)
    for kind, B, ctx in _cases(args):
        n = 1 if kind == "decode" else args.tree_size
        paged, (qd, k, v) = make_case(B, ctx, n, args, dtype, dev)
        if kind == "decode":
            def base(qd=qd, k=k, v=v, s=paged["scale"]):
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                    return F.scaled_dot_product_attention(qd, k, v, scale=s, enable_gqa=True)

            def ours(p=paged):
                return pa.launch_paged_attn(**p, max_query_len=1, split=launch["split"])
        else:
            parents = [random_tree(n, gen) for _ in range(B)]
            tmask = torch.cat([tree_mask_from_parents(p, num_mask_words(n)) for p in parents]).to(dev)
            dense = torch.ones(B, 1, n, ctx, dtype=torch.bool, device=dev)
            dense[:, 0, :, ctx - n:] = torch.stack([tree_ancestors(p) for p in parents]).to(dev)

            def base(qd=qd, k=k, v=v, m=dense, s=paged["scale"]):
                return F.scaled_dot_product_attention(qd, k, v, attn_mask=m, scale=s, enable_gqa=True)

            def ours(p=paged, t=tmask, n=n):
                return pa.launch_paged_attn(**p, max_query_len=n, tree_mask=t, split=launch["split"])
        data.append(((kind, B, ctx), ours, timed(base), ours()))  # the shipped constants' output
        print(f"[tune] {kind} {B} x {ctx}: SDPA {data[-1][2] * 1e3:.1f} us", flush=True)

    saved = (dict(pa.CONFIG[D]), pa.BLOCK_M, pa.PARTITION_SIZE)
    knobs = {"prefetch": args.prefetch, "num_stages": args.stages, "block_n": args.block_n,
             "num_warps": args.warps, "block_m": args.block_m, "partition": args.partition,
             "launch": [m for m in args.launch.split(",") if m]}
    results, tried = [], {}

    def measure(combo):
        """Time one combination (a dict of the knobs) over every case; memoised."""
        key = tuple(combo[k] for k in knobs)
        if key in tried:
            return tried[key]
        row = dict(combo, cases={})
        if combo["block_n"] < args.block_size or combo["partition"] % combo["block_n"]:
            row["error"] = "skipped: block_n must divide the partition and hold a KV block"
        else:
            pa.CONFIG[D] = dict(block_n=combo["block_n"], num_warps=combo["num_warps"],
                                num_stages=combo["num_stages"], prefetch=bool(combo["prefetch"]))
            pa.BLOCK_M, pa.PARTITION_SIZE = combo["block_m"], combo["partition"]
            launch["split"] = {"auto": None, "split": True, "fused": False}[combo["launch"]]
            try:
                for (kind, B, ctx), ours, base_ms, want in data:
                    err = float((ours().float() - want.float()).abs().max())  # (compiled outside the timing)
                    if not err <= (2e-2 if dtype == torch.bfloat16 else 1e-4):
                        raise ValueError(f"{kind} {B} x {ctx}: output off by {err:.3g} from the shipped constants'")
                    ms = timed(ours)
                    row["cases"][f"{kind}:{B}:{ctx}"] = {"us": round(ms * 1e3, 1), "vs_sdpa": round(base_ms / ms, 3)}
                ratios = [c["vs_sdpa"] for c in row["cases"].values()]
                row["geomean_vs_sdpa"] = round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3)
                row["min_vs_sdpa"] = min(ratios)
            except Exception as e:  # a combination that does not compile (shared memory, ...)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            finally:
                pa.CONFIG[D], pa.BLOCK_M, pa.PARTITION_SIZE = dict(saved[0]), saved[1], saved[2]
        tried[key] = row
        results.append(row)
        print(f"[tune] {len(results)} " + " ".join(f"{k} {combo[k]}" for k in knobs) + ": "
              + (row.get("error") or f"geomean {row['geomean_vs_sdpa']}x, min {row['min_vs_sdpa']}x SDPA"),
              flush=True)
        return row

    def score(row):
        return row.get("geomean_vs_sdpa", 0.0)

    start = {"prefetch": int(bool(saved[0].get("prefetch"))), "num_stages": saved[0]["num_stages"],
             "block_n": saved[0]["block_n"], "num_warps": saved[0]["num_warps"], "block_m": saved[1],
             "partition": saved[2], "launch": "auto"}
    search(knobs, start, measure, score, args.search, args.budget_s)
    ok = sorted((r for r in results if "error" not in r), key=lambda r: -r["geomean_vs_sdpa"])
    print("\nbest first (SDPA time / ours; > 1: ours faster)")
    names = list(ok[0]["cases"]) if ok else []
    print(f"{'prefetch':>8s} {'stages':>6s} {'block_n':>7s} {'warps':>5s} {'block_m':>7s} {'part':>5s} {'launch':>6s} "
          f"{'geomean':>8s} " + " ".join(f"{n:>16s}" for n in names))
    for r in ok[:12]:
        print(f"{r['prefetch']:8d} {r['num_stages']:6d} {r['block_n']:7d} {r['num_warps']:5d} {r['block_m']:7d} "
              f"{r['partition']:5d} {r['launch']:>6s} {r['geomean_vs_sdpa']:8.3f} "
              + " ".join(f"{r['cases'][n]['vs_sdpa']:16.3f}" for n in names))
    print(f"(now: {saved[0]}, BLOCK_M {saved[1]}, PARTITION_SIZE {saved[2]})")
    return results


def main(argv=None) -> int:
    return tune_main(parse_args(argv), run, "attention_tune")

if __name__ == "__main__":
    sys.exit(main())
