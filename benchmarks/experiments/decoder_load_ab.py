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
    from benchmarks._runner import ab_level, levels
    from specserve import LLM, SamplingParams
    from specserve.bench.load import encode, load_prompts, warm_up
    from specserve.model.llama import LlamaForCausalLM

    pairs = levels(args.levels)
    common = dict(max_num_seqs=max(c for c, _ in pairs), max_model_len=2048, enable_prefix_caching=False,
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
    warm_up(engines, max(c for c, _ in pairs), params)
    for c, n in pairs:
        runs = ab_level(engines, ids, c, n, params, first)
        if "eagle-c" in runs and "plain-c" in runs:
            base = runs[first].tokens_per_s
            print(f"   eagle over plain: layers {runs['eagle-layers'].tokens_per_s / base:.3f}, "
                  f"C decoder {runs['eagle-c'].tokens_per_s / runs['plain-c'].tokens_per_s:.3f}", flush=True)


if __name__ == "__main__":
    main()
