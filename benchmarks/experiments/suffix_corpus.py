"""Suffix decoding's cross-request corpus (spec_decode/suffix.py: SuffixCorpus) of this
checkout, optionally beside another checkout's, in one process: what a finishing request costs
the engine's step (the slowest `remember` of a long output, evictions included), the memory a
full corpus of one tenant takes, and a draft's time against a full corpus. Outputs are random
tokens over the default model's vocabulary (long n-grams occur once, as in long outputs); the
drafts of both versions must be the same trees (--base).

    python benchmarks/experiments/suffix_corpus.py [--base /path/to/other/checkout]
        [--max-match 12 64] [--lengths 1000 4000 16000] [--drafts 200]

With --load C (and --base): instead, `bench load`'s agentic loop (held-out conversations, C
in flight, prefix caching), plain decoding beside two suffix-decoding engines, one with the
other checkout's proposer swapped in, both corpora first filled with 60 filler outputs of
1,000 tokens (a full corpus), the three interleaved.
"""

import argparse
import gc
import importlib.util
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VOCAB = 49152
CORPUS_TOKENS = 1 << 16  # the default corpus_tokens


def load_suffix(checkout: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, checkout / "specserve" / "spec_decode" / "suffix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def fill(module, max_match: int, outputs: list[list[int]]) -> tuple[object, float]:
    """A proposer whose corpus took every output in turn; the slowest `remember`, in ms."""
    proposer = module.SuffixProposer(16, 1, max_match, CORPUS_TOKENS)
    worst = 0.0
    for i, out in enumerate(outputs):
        start = time.perf_counter()
        proposer.remember(str(i), out, None)
        worst = max(worst, time.perf_counter() - start)
    return proposer, worst * 1e3


def memory_mb(module, max_match: int, outputs: list[list[int]]) -> float:
    gc.collect()
    tracemalloc.start()
    proposer, _ = fill(module, max_match, outputs)
    used = tracemalloc.get_traced_memory()[0] / 2**20
    tracemalloc.stop()
    del proposer
    return used


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, help="another checkout, measured beside this one")
    p.add_argument("--max-match", type=int, nargs="+", default=[12, 64])
    p.add_argument("--lengths", type=int, nargs="+", default=[1000, 4000, 16000])
    p.add_argument("--drafts", type=int, default=200)
    p.add_argument("--load", type=int, metavar="C", help="bench load's agentic loop at C in flight (needs --base)")
    args = p.parse_args()
    versions = {"this": load_suffix(Path(__file__).resolve().parents[2], "suffix_this")}
    if args.base:
        versions["base"] = load_suffix(args.base, "suffix_base")
    if args.load:
        if not args.base:
            raise SystemExit("suffix_corpus: --load needs --base")
        return under_load(versions["base"], args.load)
    rng = random.Random(0)
    print("| max_match | output tokens | version | slowest remember (ms) | full corpus (MB) | draft (us, median) |")
    print("|---:|---:|---|---:|---:|---:|")
    for max_match in args.max_match:
        for length in args.lengths:
            outputs = [[rng.randrange(VOCAB) for _ in range(length)]
                       for _ in range(max(2, 2 * CORPUS_TOKENS // length))]  # fills it, then evicts
            kept = outputs[-max(1, CORPUS_TOKENS // length):]
            contexts = [[rng.randrange(VOCAB) for _ in range(200)] + out[100:110]
                        for out in rng.choices(kept, k=8)]
            filled = {name: fill(m, max_match, outputs) for name, m in versions.items()}
            times = {name: [] for name in versions}
            trees = {name: [] for name in versions}
            for i in range(args.drafts):  # the versions alternate
                context = contexts[i % len(contexts)]
                for name, m in versions.items():
                    proposer = filled[name][0]
                    index = m.SuffixIndex(1, max_match)
                    index.sync(context)
                    start = time.perf_counter()
                    tree = proposer.draft(context, index, proposer.corpus(None), 16)
                    times[name].append(time.perf_counter() - start)
                    trees[name].append(None if tree is None else (tree.tokens, tree.parents))
            if args.base and trees["this"] != trees["base"]:
                raise SystemExit(f"suffix_corpus: the versions drafted differently (max_match {max_match})")
            for name, m in versions.items():
                print(f"| {max_match} | {length:,} | {name} | {filled[name][1]:.1f} | "
                      f"{memory_mb(m, max_match, outputs):.1f} | {statistics.median(times[name]) * 1e6:.0f} |",
                      flush=True)


def under_load(base, concurrency: int) -> None:
    from specserve import LLM, SamplingParams
    from specserve.bench.load import agentic_prompt_ids, conversation_list, run_level, summarise_level, warm_up

    common = dict(max_num_seqs=concurrency, max_model_len=4096, enable_prefix_caching=True)
    engines = {"none": LLM(None, speculative_config=None, **common),
               "suffix": LLM(None, speculative_config={"method": "suffix"}, **common),
               "suffix-base": LLM(None, speculative_config={"method": "suffix"}, **common)}
    mine = engines["suffix-base"].engine.spec
    p = mine.proposer
    mine.proposer = base.SuffixProposer(p.max_drafts, p.min_n, p.max_n, p.corpus_tokens, p.shared)
    rng = random.Random(0)
    filler = [[rng.randrange(VOCAB) for _ in range(1000)] for _ in range(60)]
    for name in ("suffix", "suffix-base"):
        for i, out in enumerate(filler):
            engines[name].engine.spec.proposer.remember(f"filler-{i}", out, None)
    params = SamplingParams(temperature=0, max_tokens=128)
    conversations, _ = agentic_prompt_ids(engines["none"], "heldout", 128, 4096)
    warm_up(engines, concurrency, params)
    ids, after = conversation_list(conversations, concurrency, None)
    row = summarise_level(concurrency, run_level(engines, ids, concurrency, 0, 1, params, False, after))
    for name, m in row["methods"].items():
        print(f"{name}: {m['tokens_per_s']:.1f} tok/s ({m['speedup']:.3f}x plain), decode "
              f"{m['decode_speedup']:.3f}x, {m['mismatches']} mismatches")


if __name__ == "__main__":
    main()
