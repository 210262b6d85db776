"""Two builds of the CPU paged-attention kernel (specserve/kernels/cpu/paged_attention.c) side
by side in whole engines: this checkout's, and the one in another folder (--base: a folder with
paged_attention.c and the headers it includes, e.g. `git show REV:specserve/kernels/cpu/...`).
Every engine's decoder binds the kernel it was built with, so one process runs both.

  - with --kernel, the kernel alone: 30 layers' calls (each its own cache, as a step reads them
    from memory) at a few batches, contexts and rows, the builds alternating, best of 7, the
    default model's heads (9 query, 3 KV, 64 wide) and the bits compared; with --one-request,
    the same for one request at 200 to 2,000 keys and 1 / 4 / 8 / 16 rows, median of 21;
  - with --plain-long N ..., plain decoding alone of one request over prompts of N tokens, the
    two builds alternated prompt by prompt (8 prompts, 128 tokens decoded whatever comes),
    the median of this build's decode tok/s over the base build's;
  - bench load's closed loop (held-out prompts, prefix caching off, every engine's steps
    interleaved) for plain decoding and the default (EAGLE) at each --levels CONCURRENCY:REQUESTS;
  - with --long N ..., one request at a time over prompts of N tokens (held-out prompts joined),
    3 each (--long-requests), --max-tokens decoded whatever comes (decode tok/s);
  - with --agentic, the held-out agentic conversations at batch 1 (a few hundred tokens of
    context), plain decoding and suffix decoding on each build, turn by turn.

Outputs are compared with this build's plain decoding (0 mismatches expected: the builds must
give the same bits).

    python benchmarks/experiments/attention_kernel_ab.py --base /tmp/base [--levels 1:16 4:24 16:32]
        [--long 1000 2000 4000] [--agentic] [--kernel] [--one-request] [--plain-long 300 500 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


@contextlib.contextmanager
def kernel_build(lib, pick: bool = False):
    """Within: the module's kernel calls (and a decoder built meanwhile, which keeps it) go to
    lib; with pick, its AVX-512 choice is measured again at the first call (as at a start)."""
    from specserve.kernels.cpu import cpu_attention

    kernel = cpu_attention._kernel
    mine, picked = kernel._loaded, cpu_attention._picked
    kernel._loaded = lib
    if pick:
        cpu_attention._picked = False
    try:
        yield
    finally:
        kernel._loaded, cpu_attention._picked = mine, picked


def engine_with(lib, **kwargs):
    """An LLM whose decoder uses lib."""
    from specserve import LLM

    with kernel_build(lib, pick=True):
        return LLM(None, **kwargs)


KERNEL_CASES = [(1, 300, 1), (1, 300, 4), (1, 500, 1), (1, 500, 4), (1, 700, 1), (1, 1000, 1), (1, 2000, 1),
                (1, 4000, 1), (1, 2000, 3), (1, 2000, 8), (4, 1000, 1), (16, 600, 1), (16, 600, 3),
                (64, 300, 1)]  # (requests, keys, rows each)


ONE_REQUEST_CASES = [(1, keys, rows) for keys in (200, 300, 400, 500, 700, 1000, 2000) for rows in (1, 4, 8, 16)]


def kernel_ab(libs: dict, cases=KERNEL_CASES, runs: int = 7, median: bool = False) -> None:
    """The kernel alone, each build in turn (libs: name -> loaded library), per case (requests,
    keys, rows each): the best of `runs`, or their median."""
    import statistics
    import time

    import torch

    from specserve.kernels.cpu import cpu_attention

    heads, kv_heads, dim, layers, block = 9, 3, 64, 30, 16
    names = list(libs)
    print(f"the kernel alone, {layers} layers' calls, ms ({'median' if median else 'best'} of {runs}): "
          + " / ".join(names))
    for b, keys, rows in cases:
        per = (keys + rows) // block + 1
        k_caches = torch.randn(layers, b * per, block, kv_heads, dim)
        v_caches = torch.randn(layers, b * per, block, kv_heads, dim)
        q = torch.randn(b * rows, heads, dim)
        rest = (torch.arange(b * per).view(b, per), torch.arange(b + 1) * rows,
                torch.arange(keys + 1, keys + rows + 1).repeat(b), torch.zeros(b * rows + 1, dtype=torch.int64),
                torch.zeros(0, dtype=torch.int64), keys + rows, dim ** -0.5)
        times, outs = {name: [] for name in names}, {}
        for _ in range(runs):
            for name in names:
                with kernel_build(libs[name]):
                    start = time.perf_counter()
                    for i in range(layers):
                        outs[name] = cpu_attention.paged_attention(q, k_caches[i], v_caches[i], *rest)
                    times[name].append(time.perf_counter() - start)
        best = {name: statistics.median(t) if median else min(t) for name, t in times.items()}
        same = all(torch.equal(outs[names[0]], o) for o in outs.values())
        print(f"  {b:3d} requests x {keys:5d} keys, {rows} rows: "
              + " / ".join(f"{best[n] * 1e3:6.2f}" for n in names)
              + f"  ({best[names[0]] / best[names[-1]]:.2f}x)  same bits: {same}", flush=True)


def long_contexts(engines: dict, ids: list[list[int]], args) -> None:
    """--long: one request at a time over prompts of each length (the held-out prompts joined),
    every engine in turn, --max-tokens decoded (end of text ignored); decode tok/s over the
    base build's plain decoding, outputs against this build's."""
    from specserve import SamplingParams
    from specserve.bench.spec import Tally, _run_turn

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    joined = [t for one in ids for t in one]
    joined *= 1 + (max(args.long, default=0) + 200) // len(joined)
    order = {"none": engines["plain-this"], **{m: e for m, e in engines.items() if m != "plain-this"}}
    for n in args.long:
        tallies = {m: Tally() for m in order}
        for i in range(args.long_requests):
            _run_turn(order, tallies, joined[i * 97:i * 97 + n], params)
        plain = tallies["plain-base"].decode_tps
        print(f"prompts of {n} tokens, one request, decode tok/s: " + "  ".join(
            f"{m} {t.decode_tps:.1f} ({t.decode_tps / plain:.3f}; {t.accepted} tokens accepted over {t.drafts} "
            f"drafts; {t.mismatches} mismatches)" for m, t in tallies.items()), flush=True)


def plain_long(base, this, lengths: list[int], prompts: int = 8) -> None:
    """--plain-long: plain decoding of one request over prompts of each length (the held-out
    prompts joined), the two builds alternated prompt by prompt, 128 tokens decoded whatever
    comes; the median of this build's decode tok/s over the base build's."""
    import statistics

    from specserve import SamplingParams
    from specserve.bench.load import encode, load_prompts
    from specserve.bench.spec import Tally, _run_turn

    engines = {name: engine_with(lib, speculative_config=None, max_model_len=4096, enable_prefix_caching=False)
               for name, lib in (("base", base), ("this", this))}
    ids = encode(engines["this"], load_prompts("heldout"), 128, 2048)
    joined = [t for one in ids for t in one]
    joined *= 1 + (max(lengths, default=0) + 200 + 131 * prompts) // len(joined)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for n in lengths:
        ratios, tps = [], {name: [] for name in engines}
        for i in range(prompts):
            order = ["base", "this"] if i % 2 == 0 else ["this", "base"]
            tallies = {name: Tally() for name in order}
            _run_turn({name: engines[name] for name in order}, tallies, joined[i * 131:i * 131 + n], params)
            ratios.append(tallies["this"].decode_tps / tallies["base"].decode_tps)
            for name in order:
                tps[name].append(tallies[name].decode_tps)
        print(f"plain decoding, prompts of {n} tokens, one request: base {statistics.median(tps['base']):.1f} / "
              f"this {statistics.median(tps['this']):.1f} tok/s, median ratio {statistics.median(ratios):.3f}",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, type=Path, help="a folder holding the other paged_attention.c")
    p.add_argument("--levels", nargs="*", default=["1:16", "4:24", "16:32"], help="CONCURRENCY:REQUESTS")
    p.add_argument("--long", nargs="*", type=int, default=[], help="prompt lengths for one request")
    p.add_argument("--long-requests", type=int, default=3, help="prompts per --long length")
    p.add_argument("--agentic", action="store_true", help="also the agentic conversations at batch 1")
    p.add_argument("--kernel", action="store_true", help="also the kernel alone")
    p.add_argument("--one-request", action="store_true",
                   help="also the kernel alone for one request at 200-2,000 keys, 1-16 rows (median of 21)")
    p.add_argument("--plain-long", nargs="*", type=int, default=[],
                   help="prompt lengths for plain decoding of one request, the builds alternated")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()

    from benchmarks._runner import ab_level, levels
    from specserve import SamplingParams
    from specserve.bench.load import encode, load_prompts, warm_up
    from specserve.kernels.cpu import cbuild, cpu_attention

    base = ctypes.CDLL(str(cbuild.build(args.base / "paged_attention.c")))
    cpu_attention._declare(base)
    this = cpu_attention._kernel.lib
    cpu_attention.kernel_address(9, 3, 64)  # this build's AVX-512 choice, made for the base build too
    base.paged_attention_wide(int(cpu_attention.wide()))
    if args.kernel:
        kernel_ab({"base": base, "this": this})
    if args.one_request:
        kernel_ab({"base": base, "this": this}, ONE_REQUEST_CASES, runs=21, median=True)
    if args.plain_long:
        plain_long(base, this, args.plain_long)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    pairs = levels(args.levels)
    if pairs or args.long:
        room = max([2048] + [n + args.max_tokens + 8 for n in args.long])
        common = dict(max_num_seqs=max([1] + [c for c, _ in pairs]), max_model_len=room, enable_prefix_caching=False)
        engines = {f"{name}-{which}": engine_with(lib, speculative_config=config, **common)
                   for name, config in (("plain", None), ("eagle", {"method": "eagle"}))
                   for which, lib in (("base", base), ("this", this))}
        ids = encode(engines["plain-this"], load_prompts("heldout"), args.max_tokens, 2048)
        warm_up(engines, common["max_num_seqs"], params)
        for c, n in pairs:
            ab_level(engines, ids, c, n, params, "plain-base", "plain-this")
        long_contexts(engines, ids, args)
        del engines
    if args.agentic:
        from specserve.bench.spec import Tally, load_conversations, run_conversations

        common = dict(max_model_len=4096)
        engines = {"none": engine_with(this, speculative_config=None, **common),
                   "none-base": engine_with(base, speculative_config=None, **common),
                   "suffix": engine_with(this, speculative_config={"method": "suffix"}, **common),
                   "suffix-base": engine_with(base, speculative_config={"method": "suffix"}, **common)}
        tallies = {name: Tally() for name in engines}
        run_conversations(engines, load_conversations("heldout"), lambda conv: tallies, params,
                          4096 - args.max_tokens - 8)
        plain = tallies["none-base"].decode_tps
        print("agentic, held-out, batch 1 (decode tok/s, over the base build's plain decoding):")
        for name, t in tallies.items():
            print(f"  {name:12s} {t.decode_tps:6.1f} tok/s ({t.decode_tps / plain:.2f}x)  mismatches {t.mismatches}")


if __name__ == "__main__":
    main()
