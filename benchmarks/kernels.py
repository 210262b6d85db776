"""Benchmark specserve's Triton attention kernels against PyTorch baselines (CUDA only).

* decode:  paged_attention (one query per request, paged cache) vs
           torch SDPA (flash backend) on the gathered contiguous cache.
* tree:    tree_attention (n draft nodes per request, packed bitmask) vs
           flex_attention with a block mask and vs SDPA with a dense bool mask.

Reported bandwidth = bytes of K/V read (B * context * Hkv * D * 2 * elem) / time,
also as a fraction of --peak-gbps (H100 SXM HBM3: 3350 GB/s).  Baselines read a
contiguous copy of the cache that is built outside the timed region (if the
flash backend lacks native GQA, "sdpa_flash_x" runs on K/V expanded to Hq heads;
its bandwidth still counts only the Hkv bytes).

    python benchmarks/kernels.py --out bench_out            # full sweep
    python benchmarks/kernels.py --contexts 1024 --batches 1 --tree-sizes 8
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--contexts", type=ints, default=[1024, 4096, 16384], help="comma-separated context lengths")
    p.add_argument("--batches", type=ints, default=[1, 16, 64])
    p.add_argument("--tree-sizes", type=ints, default=[8, 32, 64])
    p.add_argument("--tree-batch", type=int, default=None, help="batch for tree runs (default: each --batches)")
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--peak-gbps", type=float, default=3350.0, help="peak memory bandwidth in GB/s")
    p.add_argument("--skip", default="", help="comma-separated impls to skip: sdpa,flex,sdpa_mask")
    p.add_argument("--out", default="benchmarks/out", help="directory for kernels.json / kernels.png")
    return p.parse_args(argv)


def make_case(B, ctx, n_q, args, dtype, dev):
    """Paged cache with shuffled blocks + the same K/V gathered contiguously."""
    bs, Hkv, D, Hq = args.block_size, args.num_kv_heads, args.head_dim, args.num_q_heads
    nb_per = (ctx + bs - 1) // bs
    k_cache = torch.randn(B * nb_per, bs, Hkv, D, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(B * nb_per, device=dev, dtype=torch.int32).view(B, nb_per)
    seq_lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    qsl = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * n_q
    q = torch.randn(B * n_q, Hq, D, device=dev, dtype=dtype)
    pos = torch.arange(ctx, device=dev)
    bid = block_tables.long()[:, pos // bs]  # [B, ctx]
    k = k_cache[bid, pos % bs].permute(0, 2, 1, 3).contiguous()  # [B, Hkv, ctx, D]
    v = v_cache[bid, pos % bs].permute(0, 2, 1, 3).contiguous()
    qd = q.view(B, n_q, Hq, D).transpose(1, 2).contiguous()  # [B, Hq, n_q, D]
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
                query_start_loc=qsl, scale=D ** -0.5), (qd, k, v)


def random_tree(n, gen):
    parents = [-1] + [int(torch.randint(-1, i, (), generator=gen)) for i in range(1, n)]
    return torch.tensor(parents, dtype=torch.long)


def run(args):
    import triton.testing
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from specserve.kernels import paged_attention_triton, tree_attention_triton
    from specserve.kernels.triton.tree_attention import num_mask_words, tree_ancestors, tree_mask_from_parents

    dev = "cuda"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    skip = set(args.skip.split(","))
    elem = torch.finfo(dtype).bits // 8
    flex = create_block_mask = None
    if "flex" not in skip:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            from torch._dynamo import config as dynamo_config  # not `import torch._dynamo`:
            # that would make `torch` a local name of run() and break its earlier uses

            for knob in ("cache_size_limit", "recompile_limit"):  # one compile per shape / mask
                if hasattr(dynamo_config, knob):
                    setattr(dynamo_config, knob, 256)
            flex = torch.compile(flex_attention, dynamic=False)
        except Exception as e:  # pragma: no cover - depends on torch build
            print(f"[warn] flex_attention unavailable: {e}", file=sys.stderr)
    rows = []

    def bench(kind, impl, B, ctx, n_q, fn, ref=None):
        try:
            out = fn()
            err = float((out.float() - ref.float()).abs().max()) if ref is not None else 0.0
            ms = triton.testing.do_bench(fn, warmup=25, rep=100)
        except Exception as e:  # keep the sweep going; record why
            print(f"[warn] {kind}/{impl} B={B} ctx={ctx} n={n_q}: {type(e).__name__}: {e}", file=sys.stderr)
            return None
        gbytes = B * ctx * args.num_kv_heads * args.head_dim * 2 * elem / 1e9
        gbps = gbytes / (ms / 1e3)
        row = dict(kind=kind, impl=impl, batch=B, context=ctx, q_per_seq=n_q, ms=ms, gbps=gbps,
                   peak_frac=gbps / args.peak_gbps, max_abs_err=err)
        rows.append(row)
        print(f"{kind:7s} {impl:10s} {B:5d} {ctx:7d} {n_q:4d} {ms * 1e3:10.1f} {gbps:9.1f} "
              f"{100 * gbps / args.peak_gbps:6.1f}% {err:9.2e}", flush=True)
        return out

    print(f"{'kind':7s} {'impl':10s} {'batch':>5s} {'context':>7s} {'nq':>4s} {'us':>10s} {'GB/s':>9s} "
          f"{'%peak':>7s} {'max_err':>9s}")
    gen = torch.Generator().manual_seed(0)
    for ctx in args.contexts:
        for B in args.batches:
            # ---- decode ------------------------------------------------------
            paged, (qd, k, v) = make_case(B, ctx, 1, args, dtype, dev)
            tri = bench("decode", "triton", B, ctx, 1, lambda: paged_attention_triton(**paged, max_query_len=1))
            ref = tri.view(B, 1, -1, args.head_dim).transpose(1, 2) if tri is not None else None
            if "sdpa" not in skip:
                def sdpa_flash():
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        return F.scaled_dot_product_attention(qd, k, v, scale=paged["scale"], enable_gqa=True)
                if bench("decode", "sdpa_flash", B, ctx, 1, sdpa_flash, ref) is None:
                    # flash without native GQA support: expand K/V (outside the timed region)
                    g = args.num_q_heads // args.num_kv_heads
                    kx, vx = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

                    def sdpa_flash_x():
                        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                            return F.scaled_dot_product_attention(qd, kx, vx, scale=paged["scale"])
                    bench("decode", "sdpa_flash_x", B, ctx, 1, sdpa_flash_x, ref)
                    kx = vx = None
            paged = qd = k = v = tri = ref = None  # free before the next case
            # ---- tree verification ------------------------------------------
            Bt = args.tree_batch or B
            for n in args.tree_sizes:
                prefix = ctx - n
                paged, (qd, k, v) = make_case(Bt, ctx, n, args, dtype, dev)
                parents = [random_tree(n, gen) for _ in range(Bt)]
                W = num_mask_words(n)
                tmask = torch.cat([tree_mask_from_parents(p, W) for p in parents]).to(dev)
                anc = torch.stack([tree_ancestors(p) for p in parents]).to(dev)  # [Bt, n, n]
                tri = bench("tree", "triton", Bt, ctx, n,
                            lambda: tree_attention_triton(**paged, tree_mask=tmask, max_query_len=n))
                ref = tri.view(Bt, n, -1, args.head_dim).transpose(1, 2) if tri is not None else None
                if flex is not None:
                    def mask_mod(b, h, q_idx, kv_idx):
                        node = (kv_idx - prefix).clamp(min=0)
                        return (kv_idx < prefix) | anc[b, q_idx, node]
                    try:
                        bm = create_block_mask(mask_mod, Bt, None, n, ctx, device=dev)
                        bench("tree", "flex", Bt, ctx, n,
                              lambda: flex(qd, k, v, block_mask=bm, scale=paged["scale"], enable_gqa=True), ref)
                    except Exception as e:  # pragma: no cover
                        print(f"[warn] flex block mask: {type(e).__name__}: {e}", file=sys.stderr)
                if "sdpa_mask" not in skip:
                    dense = torch.ones(Bt, 1, n, ctx, dtype=torch.bool, device=dev)
                    dense[:, 0, :, prefix:] = anc
                    bench("tree", "sdpa_mask", Bt, ctx, n,
                          lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=dense, scale=paged["scale"],
                                                                 enable_gqa=True), ref)
                    dense = None
                paged = qd = k = v = tri = ref = None  # free before the next case
                torch.cuda.empty_cache()
    return rows


def plot(rows, path, peak):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[warn] matplotlib missing: no plot written", file=sys.stderr)
        return
    kinds = sorted({r["kind"] for r in rows})
    fig, axes = plt.subplots(1, len(kinds), figsize=(7 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        sel = [r for r in rows if r["kind"] == kind]
        series = sorted({(r["impl"], r["batch"], r["q_per_seq"]) for r in sel})
        for impl, B, nq in series:
            pts = sorted((r["context"], r["peak_frac"]) for r in sel
                         if (r["impl"], r["batch"], r["q_per_seq"]) == (impl, B, nq))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=f"{impl} B={B}" + (f" n={nq}" if kind == "tree" else ""))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length")
        ax.set_ylabel(f"K/V bandwidth / peak ({peak:.0f} GB/s)")
        ax.set_title(kind)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to do.",
              file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("benchmarks/kernels.py needs triton installed.", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {args.dtype}  "
          f"Hq={args.num_q_heads} Hkv={args.num_kv_heads} D={args.head_dim} block={args.block_size}")
    rows = run(args)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, peak_gbps=args.peak_gbps,
                args=vars(args))
    with open(os.path.join(args.out, "kernels.json"), "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=1)
    print(f"wrote {os.path.join(args.out, 'kernels.json')}")
    if rows:
        plot(rows, os.path.join(args.out, "kernels.png"), args.peak_gbps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
