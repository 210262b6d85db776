"""bench load's loop with the decoder layers run both ways side by side: plain decoding and
EAGLE, each on an engine whose model runs its layers one by one from Python and on one whose
layers run in one C call (specserve/kernels/cpu/decoder.c, the default); every engine's steps
interleaved, held-out prompts, prefix caching off. Each engine measures its own step costs at
start (the layer-by-layer engines are built with the C decoder off), and every output is
checked against the layer-by-layer plain engine's (0 mismatches expected: the same bits).

    python benchmarks/experiments/decoder_load_ab.py [--levels 1:24 4:24 16:32] [--max-tokens 128]
        [--quantization none|int8|gguf]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", nargs="+", default=["1:24", "4:24", "16:32"], help="CONCURRENCY:REQUESTS")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--quantization", default="none", choices=["none", "int8", "gguf"])
    p.add_argument("--methods", nargs="+", default=["plain", "eagle"], choices=["plain", "eagle"])
    args = p.parse_args()
    from specserve import LLM, SamplingParams
    from specserve.bench.load import ClosedLoop, encode, interleaved, load_prompts, request_list, warm_up
    from specserve.model.llama import LlamaForCausalLM

    levels = [tuple(map(int, level.split(":"))) for level in args.levels]
    common = dict(max_num_seqs=max(c for c, _ in levels), max_model_len=2048, enable_prefix_caching=False,
                  quantization=args.quantization)
    configs = {"plain": None, "eagle": {"method": "eagle"}}
    build = LlamaForCausalLM._c_decoder
    engines = {}
    for name in args.methods:
        for which in ("layers", "c"):
            LlamaForCausalLM._c_decoder = build if which == "c" else (lambda self: None)
            try:
                llm = LLM(None, speculative_config=configs[name], **common)
            finally:
                LlamaForCausalLM._c_decoder = build
            assert (llm.engine.runner.model.decoder is not None) == (which == "c")
            engines[f"{name}-{which}"] = llm
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    first = next(iter(engines))
    ids = encode(engines[first], load_prompts("heldout"), args.max_tokens, 2048)
    warm_up(engines, max(c for c, _ in levels), params)
    for c, n in levels:
        names = list(engines)
        runs = dict(zip(names, interleaved([ClosedLoop(engines[m].engine, request_list(ids, c, n), c, params,
                                                       f"{m}-c{c}") for m in names])))
        base, ref = runs[first].tokens_per_s, runs[first].outputs
        print(f"c={c}: " + "  ".join(f"{m} {r.tokens_per_s:.1f} tok/s ({r.tokens_per_s / base:.3f})"
                                    for m, r in runs.items()))
        if "eagle-c" in runs and "plain-c" in runs:
            print(f"   eagle over plain: layers {runs['eagle-layers'].tokens_per_s / base:.3f}, "
                  f"C decoder {runs['eagle-c'].tokens_per_s / runs['plain-c'].tokens_per_s:.3f}")
        print(f"   mismatches against {first}:",
              {m: sum(a != b for a, b in zip(r.outputs, ref)) for m, r in runs.items()}, flush=True)


if __name__ == "__main__":
    main()
