"""What `--quantization gguf` (int8 activations against the GGUF blocks) changes for plain
decoding and for speculation at batch 1: the engines of `specserve bench spec` (plain, ngram,
eagle) built twice, float32 over the blocks (the default) and gguf, every prompt through all
six in turn (the order rotated prompt by prompt), so that both sets see the same machine.
Each speculative engine is checked against its own set's plain decoding (0 mismatches: lossless
within a set; the two sets' answers differ, as their products round otherwise).

    python benchmarks/experiments/gguf_spec.py [--skip 5] [--limit 5] [--max-tokens 128]
        [--category qa ...] [--json OUT.json] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    from tqdm import tqdm

    from specserve import SamplingParams
    from specserve.bench import spec

    p = spec.add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="a PNG of every engine's decode tok/s over float32 plain decoding's")
    args = p.parse_args()
    args.eagle = args.eagle or "default"
    sets = {}
    for q in ("none", "gguf"):
        args.quantization = q
        sets[q] = spec.build_engines(args, [])
    categories = args.category or spec.CATEGORIES
    prompts = spec.load_prompts(categories, args.limit, False, args.skip)
    tallies = {q: {c: {m: spec.Tally() for m in engines} for c in categories} for q, engines in sets.items()}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    room = args.max_model_len - args.max_tokens - 8
    for i, (cat, turn) in enumerate(tqdm(prompts, desc="gguf vs float32", unit="prompt")):
        ids = sets["none"]["none"].apply_chat_template([{"role": "user", "content": turn}])[-room:]
        for q in (("none", "gguf") if i % 2 == 0 else ("gguf", "none")):
            engines = sets[q]
            names = list(engines)
            turn_order = names[i % len(names):] + names[:i % len(names)]
            turn_order.remove("none")  # plain first: the reference for mismatches
            spec._run_turn({"none": engines["none"], **{n: engines[n] for n in turn_order}}, tallies[q][cat], ids,
                           params)
    result = {q: spec._summarise(args, tallies[q], list(sets[q])) for q in sets}
    for q, r in result.items():
        print(f"--quantization {q}:")
        spec._print_table(r)
    base = result["none"]["overall"]["none"]["decode_tokens_per_s"]
    print("decode tok/s over float32 plain decoding: " + ", ".join(
        f"{q}/{m} {o['decode_tokens_per_s'] / base:.2f}x" for q, r in result.items() for m, o in r["overall"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, Path(args.plot))


def plot(result: dict, path: Path) -> None:
    """Each engine's decode tok/s per category over float32 plain decoding's there."""
    from specserve.bench.spec import grouped_bars

    rows = {(q, r["category"], r["method"]): r["decode_tokens_per_s"] for q, res in result.items() for r in res["rows"]}
    cats = list(dict.fromkeys(c for _, c, _ in rows))
    names = list(dict.fromkeys((q, m) for q, _, m in rows))
    series = {("" if q == "none" else f"{q} ") + ("plain" if m == "none" else m):
              [rows[(q, c, m)] / rows[("none", c, "none")] for c in cats] for q, m in names}
    grouped_bars(path, cats, series, "decode tok/s over float32 plain decoding",
                 f"Spec-Bench, greedy, batch 1: float32 blocks and --quantization gguf ({result['none']['date']})",
                 baseline=1.0, rotation=20)


if __name__ == "__main__":
    main()
