"""bench load's loop with the EAGLE head's pass run both ways side by side: in Python over
per-request K/V (SDPA attention, SPECSERVE_DRAFT_KV=per_request) and as one C call over a paged
pool (specserve/kernels/cpu/decoder.c: head_pass, the default on a CPU float32 model), beside
plain decoding; every engine's steps interleaved, held-out prompts, prefix caching off. Each
engine measures its own costs at start; every output is checked against plain decoding's.

    python benchmarks/experiments/head_pass_ab.py [--levels 1:24 4:24 16:32] [--max-tokens 128]
        [--quantization none|int8|gguf] [--dtype auto|float32]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", nargs="+", default=["1:24", "4:24", "16:32"], help="CONCURRENCY:REQUESTS")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--quantization", default="none", choices=["none", "int8", "gguf"])
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    from benchmarks._runner import ab_level, levels
    from specserve import LLM, SamplingParams
    from specserve.bench.load import encode, load_prompts, warm_up

    pairs = levels(args.levels)
    common = dict(max_num_seqs=max(c for c, _ in pairs), max_model_len=2048, enable_prefix_caching=False,
                  quantization=args.quantization, dtype=args.dtype)
    engines = {"plain": LLM(None, speculative_config=None, **common)}
    for name, kv in (("eagle-python", "per_request"), ("eagle-c", "auto")):
        os.environ["SPECSERVE_DRAFT_KV"] = kv  # read as the proposer is built
        try:
            engines[name] = LLM(None, speculative_config={"method": "eagle"}, **common)
        finally:
            del os.environ["SPECSERVE_DRAFT_KV"]
        c_pass = engines[name].engine.spec.proposer.pool is not None
        print(f"{name}: head pass in C: {c_pass}", flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    ids = encode(engines["plain"], load_prompts("heldout"), args.max_tokens, 2048)
    warm_up(engines, max(c for c, _ in pairs), params)
    for c, n in pairs:
        ab_level(engines, ids, c, n, params, "plain")


if __name__ == "__main__":
    main()
