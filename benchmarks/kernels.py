"""Benchmark specserve's Triton attention kernels against PyTorch baselines.

* decode:  paged_attention (one query per request, paged cache) vs
           torch SDPA (flash backend) on the gathered contiguous cache.
* tree:    tree_attention (n draft nodes per request, packed bitmask) vs
           flex_attention (compiled, block mask built once per case) and vs SDPA with a
           dense bool mask, at the same masks.
* prefill: paged_attention with a chunk of queries per request (causal, the chunk last in its
           context, as a prefill chunk after a cached prefix) vs SDPA (flash / efficient) with
           the lower-right causal bias on the gathered cache (`--prefill-chunks`,
           `--prefill-batches`).

Reported bandwidth = bytes of K/V read (B * context * Hkv * D * 2 * elem) / time, and its share
of the device's peak memory bandwidth: --peak-gbps, else looked up by device name (H100 SXM
3350 GB/s, H200 4800, ...; unknown devices get no share).  Baselines read a contiguous copy of
the cache that is built outside the timed region (if the flash backend lacks native GQA,
"sdpa_flash_x" runs on K/V expanded to Hq heads; its bandwidth still counts only the Hkv
bytes).  A summary table ends the run: each case's time and ours against SDPA and flex
("vs" = baseline time / our time; > 1 means ours is faster), or why a baseline could not run.
Times on CUDA are the GPU's, each call replayed from a CUDA graph after a write that evicts L2
(`graph_time_ms`): what a call costs inside the engine's graph-replayed step, where the host's
launches cost nothing.

    python benchmarks/kernels.py --out bench_out            # full sweep (CUDA)
    python benchmarks/kernels.py --contexts 1024 --batches 1 --tree-sizes 8
    python benchmarks/kernels.py --device cpu --contexts 300 --batches 1 --tree-sizes 8 \
        --num-q-heads 4 --num-kv-heads 2 --head-dim 64 --skip flex   # smoke run, interpreter
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--contexts", type=ints, default=[1024, 4096, 16384], help="comma-separated context lengths")
    p.add_argument("--batches", type=ints, default=[1, 16, 64])
    p.add_argument("--tree-sizes", type=ints, default=[8, 32, 64])
    p.add_argument("--tree-batch", type=int, default=None, help="batch for tree runs (default: each --batches)")
    p.add_argument("--prefill-chunks", type=ints, default=[512],
                   help="queries per request of the prefill cases (none: no prefill cases)")
    p.add_argument("--prefill-batches", type=ints, default=[1, 16], help="requests of the prefill cases")
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--peak-gbps", type=float, default=None,
                   help="peak memory bandwidth in GB/s (default: by device name, see PEAK_GBPS)")
    p.add_argument("--skip", default="", help="comma-separated impls to skip: sdpa,flex,sdpa_mask")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a smoke run, the Triton kernels interpreted (TRITON_INTERPRET=1)")
    p.add_argument("--out", default="benchmarks/out", help="directory for kernels.json / kernels.png")
    return p.parse_args(argv)


# Peak memory bandwidth (GB/s) by device-name substring, most specific first.
PEAK_GBPS = [("H200", 4800.0), ("GH200", 4000.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0),
             ("H100", 3350.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0),
             ("L40S", 864.0), ("L4", 300.0)]


def device_peak_gbps(name: str):
    for key, gbps in PEAK_GBPS:
        if key in name:
            return gbps
    return None


def first_line(e: BaseException) -> str:
    """An exception as one line: its type and the first non-empty line of its message."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def time_ms(fn, dev, warmup=25, rep=100, cpu_reps=3) -> float:
    """Milliseconds of one call of fn. On CUDA the GPU's time, as a step replayed from a CUDA
    graph spends it (graph_time_ms; triton's do_bench where fn cannot be captured, which then
    also counts the host's launches of a small call). On a CPU the median of a few calls (the
    interpreter: a smoke run, not a timing)."""
    if dev == "cuda":
        try:
            return graph_time_ms(fn)
        except Exception as e:  # pragma: no cover - depends on fn and the torch build
            print(f"[time_ms] no CUDA graph ({first_line(e)}): timing the launches too", flush=True)
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup, rep=rep)
    times = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


_FLUSH: dict = {}  # flush_mb -> the CUDA buffer graph_time_ms writes to evict L2


def graph_time_ms(fn, calls: int = 20, trials: int = 7, flush_mb: int = 256) -> float:
    """GPU milliseconds of one call of fn with a cold L2: fn captured `calls` times in a CUDA
    graph, each call after a write of `flush_mb` MB (which evicts the cache), replayed `trials`
    times; the same graph of the writes alone is timed likewise and taken off (medians). The
    host's launches cost nothing here, as in a step replayed from the engine's graphs."""
    import torch

    flush = _FLUSH.get(flush_mb)
    if flush is None:  # one buffer per process, not one per timed call
        flush = _FLUSH[flush_mb] = torch.empty(flush_mb << 20, dtype=torch.int8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles and allocator warm-up off the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = {}
    for name, body in (("both", lambda: (flush.zero_(), fn())), ("flush", flush.zero_)):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                body()
        graphs[name] = g

    def replay_ms(g) -> float:
        g.replay()  # warm
        times = []
        for _ in range(trials):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    return max(0.0, replay_ms(graphs["both"]) - replay_ms(graphs["flush"])) / calls


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


def flex_runner(args, dev):
    """flex_attention compiled once (static shapes; one compile per shape and mask), or the
    reason it cannot be. Returns (fn, None) or (None, reason)."""
    try:
        from torch._dynamo import config as dynamo_config  # not `import torch._dynamo`: that
        from torch.nn.attention.flex_attention import flex_attention  # would make `torch` local

        for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(dynamo_config, knob):
                setattr(dynamo_config, knob, max(getattr(dynamo_config, knob), 512))
        return torch.compile(flex_attention, dynamic=False), None
    except Exception as e:  # pragma: no cover - depends on the torch build
        return None, f"flex_attention unavailable: {first_line(e)}"


def run(args):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from specserve.kernels import paged_attention_triton, tree_attention_triton
    from specserve.kernels.triton.tree_attention import num_mask_words, tree_ancestors, tree_mask_from_parents

    dev = args.device
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if dev == "cpu":
        dtype = torch.float32  # the interpreter's dot wants float32 or float16 inputs
    skip = set(args.skip.split(","))
    elem = torch.finfo(dtype).bits // 8
    peak = args.peak_gbps
    flex, flex_reason = (None, "skipped (--skip flex)") if "flex" in skip else flex_runner(args, dev)
    if flex_reason and "flex" not in skip:
        print(f"[warn] {flex_reason}", file=sys.stderr)
    rows, notes = [], {}  # notes[(kind, impl, B, ctx, n)] = why it has no figure

    def timed(fn):
        return time_ms(fn, dev)

    def bench(kind, impl, B, ctx, n_q, fn, ref=None):
        try:
            out = fn()
            err = float((out.float() - ref.float()).abs().max()) if ref is not None else 0.0
            ms = timed(fn)
        except Exception as e:  # keep the sweep going; record why
            notes[(kind, impl, B, ctx, n_q)] = first_line(e)
            print(f"[warn] {kind}/{impl} B={B} ctx={ctx} n={n_q}: {first_line(e)}", file=sys.stderr)
            return None
        gbytes = B * ctx * args.num_kv_heads * args.head_dim * 2 * elem / 1e9
        gbps = gbytes / (ms / 1e3)
        row = dict(kind=kind, impl=impl, batch=B, context=ctx, q_per_seq=n_q, ms=ms, gbps=gbps,
                   peak_frac=gbps / peak if peak else None, max_abs_err=err)
        rows.append(row)
        share = f"{100 * gbps / peak:6.1f}%" if peak else f"{'n/a':>7s}"
        print(f"{kind:7s} {impl:12s} {B:5d} {ctx:7d} {n_q:4d} {ms * 1e3:10.1f} {gbps:9.1f} {share} {err:9.2e}",
              flush=True)
        return out

    print(f"{'kind':7s} {'impl':12s} {'batch':>5s} {'context':>7s} {'nq':>4s} {'us':>10s} {'GB/s':>9s} "
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
                    bench_flex(bench, notes, flex, Bt, ctx, n, prefix, anc, qd, k, v, paged["scale"], ref, args, dev)
                if "sdpa_mask" not in skip:
                    dense = torch.ones(Bt, 1, n, ctx, dtype=torch.bool, device=dev)
                    dense[:, 0, :, prefix:] = anc
                    bench("tree", "sdpa_mask", Bt, ctx, n,
                          lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=dense, scale=paged["scale"],
                                                                 enable_gqa=True), ref)
                    dense = None
                paged = qd = k = v = tri = ref = anc = None  # free before the next case
                if dev == "cuda":
                    torch.cuda.empty_cache()
        for B in args.prefill_batches:
            for n in (c for c in args.prefill_chunks if c <= ctx):
                bench_prefill(bench, skip, B, ctx, n, args, dtype, dev)
                if dev == "cuda":
                    torch.cuda.empty_cache()
    summary = summarise(rows, notes, args, flex_reason)
    return rows, summary


def bench_prefill(bench, skip, B, ctx, n, args, dtype, dev):
    """A prefill chunk of n queries per request, the last n of its context: ours (the paged
    kernel, causal) against SDPA with the lower-right causal bias (flash or efficient), else a
    dense bool mask."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from specserve.kernels import paged_attention_triton

    paged, (qd, k, v) = make_case(B, ctx, n, args, dtype, dev)
    tri = bench("prefill", "triton", B, ctx, n, lambda: paged_attention_triton(**paged, max_query_len=n))
    ref = tri.view(B, n, -1, args.head_dim).transpose(1, 2) if tri is not None else None
    if "sdpa" in skip:
        return
    bias = causal_lower_right(n, ctx)

    def sdpa_flash():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(qd, k, v, attn_mask=bias, scale=paged["scale"], enable_gqa=True)
    if bench("prefill", "sdpa_flash", B, ctx, n, sdpa_flash, ref) is None:
        dense = torch.ones(n, ctx, dtype=torch.bool, device=dev).tril(ctx - n)
        bench("prefill", "sdpa_mask", B, ctx, n,
              lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=dense, scale=paged["scale"],
                                                     enable_gqa=True), ref)


FLEX_FAILED: dict[str, str] = {}  # flex variants that failed to compile, with why


def bench_flex(bench, notes, flex, Bt, ctx, n, prefix, anc, qd, k, v, scale, ref, args, dev):
    """flex_attention at the tree masks, trying the variants a torch build may need in turn:
    the default dispatch (for fewer than 128 queries: its decoding kernel), then its main kernel
    (FORCE_USE_FLEX_ATTENTION), then K/V expanded to Hq heads (no GQA). The first that runs is
    timed as "flex"; if none runs, notes says why each failed."""
    from torch.nn.attention.flex_attention import create_block_mask

    anc_flat = anc.reshape(Bt, n * n)

    def mask_mod(b, h, q_idx, kv_idx):
        # prefix always visible; node j visible iff it is q_idx's ancestor (or q_idx itself)
        node = (kv_idx - prefix).clamp(min=0, max=n - 1)
        return (kv_idx < prefix) | anc_flat[b, q_idx.clamp(max=n - 1) * n + node]

    try:
        bm = create_block_mask(mask_mod, Bt, None, n, ctx, device=dev)
    except Exception as e:
        notes[("tree", "flex", Bt, ctx, n)] = f"block mask: {first_line(e)}"
        print(f"[warn] flex block mask: {first_line(e)}", file=sys.stderr)
        return
    g = args.num_q_heads // args.num_kv_heads
    variants = [
        ("default", lambda: flex(qd, k, v, block_mask=bm, scale=scale, enable_gqa=True)),
        ("FORCE_USE_FLEX_ATTENTION", lambda: flex(qd, k, v, block_mask=bm, scale=scale, enable_gqa=True,
                                                  kernel_options={"FORCE_USE_FLEX_ATTENTION": True})),
    ]
    if g > 1:
        kx, vx = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # outside the timed region
        variants.append(("K/V expanded, no GQA", lambda: flex(qd, kx, vx, block_mask=bm, scale=scale)))
    failures = []
    for name, fn in variants:
        if name in FLEX_FAILED:  # failed to compile at an earlier case: not tried again (each try compiles)
            failures.append(f"{name}: {FLEX_FAILED[name]} (at an earlier case)")
            continue
        try:
            fn()  # compile outside bench(), so a failure names the variant
        except Exception as e:
            failures.append(f"{name}: {first_line(e)}")
            FLEX_FAILED[name] = first_line(e)
            print(f"[warn] flex ({name}) B={Bt} ctx={ctx} n={n}: {first_line(e)}", file=sys.stderr)
            continue
        if bench("tree", "flex", Bt, ctx, n, fn, ref) is not None:
            notes.pop(("tree", "flex", Bt, ctx, n), None)
            if failures:
                notes[("tree", "flex", Bt, ctx, n)] = f"ran as {name} after: " + "; ".join(failures)
            return
        failures.append(f"{name}: {notes.get(('tree', 'flex', Bt, ctx, n), 'failed')}")
    notes[("tree", "flex", Bt, ctx, n)] = "; ".join(failures)


def summarise(rows, notes, args, flex_reason):
    """One line per case: our time, and ours against SDPA and flex (baseline time / ours), or
    why a baseline has no figure."""
    ms = {(r["kind"], r["impl"], r["batch"], r["context"], r["q_per_seq"]): r["ms"] for r in rows}
    cases = sorted({(r["kind"], r["batch"], r["context"], r["q_per_seq"]) for r in rows if r["impl"] == "triton"},
                   key=lambda c: (c[0], c[2], c[1], c[3]))
    out = []
    print(f"\n{'kind':7s} {'batch':>5s} {'context':>7s} {'nq':>4s} {'ours us':>9s} {'vs sdpa':>8s} {'vs flex':>8s}")
    for kind, B, ctx, n in cases:
        ours = ms[(kind, "triton", B, ctx, n)]
        sdpa_impls = {"decode": ("sdpa_flash", "sdpa_flash_x"), "prefill": ("sdpa_flash", "sdpa_mask")}.get(
            kind, ("sdpa_mask",))
        sdpa = next((ms[(kind, i, B, ctx, n)] for i in sdpa_impls if (kind, i, B, ctx, n) in ms), None)
        flex = ms.get((kind, "flex", B, ctx, n))
        if kind != "tree":
            flex_why = "not measured"
        else:
            flex_why = notes.get((kind, "flex", B, ctx, n)) or flex_reason or "not measured"
        row = dict(kind=kind, batch=B, context=ctx, q_per_seq=n, ours_ms=ours,
                   vs_sdpa=sdpa / ours if sdpa else None, vs_flex=flex / ours if flex else None,
                   flex_note=None if flex else flex_why)
        out.append(row)
        fmt = lambda x: f"{x:7.2f}x" if x is not None else f"{'-':>8s}"  # noqa: E731
        print(f"{kind:7s} {B:5d} {ctx:7d} {n:4d} {ours * 1e3:9.1f} {fmt(row['vs_sdpa'])} {fmt(row['vs_flex'])}"
              + (f"  flex: {flex_why}" if flex is None and kind == "tree" else ""))
    return out


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
            pts = sorted((r["context"], r["peak_frac"] if peak else r["gbps"]) for r in sel
                         if (r["impl"], r["batch"], r["q_per_seq"]) == (impl, B, nq))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=f"{impl} B={B}" + (f" n={nq}" if kind != "decode" else ""))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length")
        ax.set_ylabel(f"K/V bandwidth / peak ({peak:.0f} GB/s)" if peak else "K/V bandwidth (GB/s)")
        ax.set_title(kind)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to do "
              "(--device cpu runs a smoke test of the kernels interpreted).", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    try:
        import triton  # noqa: F401
    except ImportError:
        print("benchmarks/kernels.py needs triton installed.", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    if args.peak_gbps is None and args.device == "cuda":
        args.peak_gbps = device_peak_gbps(name)
    os.makedirs(args.out, exist_ok=True)
    peak = f"{args.peak_gbps:.0f} GB/s" if args.peak_gbps else "unknown (pass --peak-gbps)"
    dtype = args.dtype if args.device == "cuda" else "fp32"
    print(f"device: {name}  torch {torch.__version__}  dtype {dtype}  peak {peak}  "
          f"Hq={args.num_q_heads} Hkv={args.num_kv_heads} D={args.head_dim} block={args.block_size}")
    rows, summary = run(args)
    meta = dict(device=name, torch=torch.__version__, peak_gbps=args.peak_gbps, args=vars(args))
    with open(os.path.join(args.out, "kernels.json"), "w") as f:
        json.dump(dict(meta=meta, results=rows, summary=summary), f, indent=1)
    print(f"wrote {os.path.join(args.out, 'kernels.json')}")
    if rows:
        plot(rows, os.path.join(args.out, "kernels.png"), args.peak_gbps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
