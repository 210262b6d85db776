"""bench load's loop with two attention backends side by side: plain decoding and EAGLE, each
on an engine whose runner attends with the backend of another checkout's cpu_paged.py (--old,
e.g. `git show REV:specserve/model/attention/cpu_paged.py > /tmp/old/old_cpu_paged.py` with its
relative imports made absolute) and on one with this checkout's; every engine's steps
interleaved, held-out prompts, prefix caching off, 0 mismatches expected against this
checkout's plain decoding.

    python benchmarks/experiments/attention_load_ab.py --old /tmp/old [--levels 1:24 16:32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="a folder holding old_cpu_paged.py")
    p.add_argument("--levels", nargs="+", default=["1:24", "16:32"], help="CONCURRENCY:REQUESTS")
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()
    sys.path.insert(0, args.old)
    from old_cpu_paged import CPUPagedAttention as Old

    from benchmarks._runner import ab_level, levels
    from specserve import LLM, SamplingParams
    from specserve.bench.load import encode, load_prompts, warm_up

    pairs = levels(args.levels)
    common = dict(max_num_seqs=max(c for c, _ in pairs), max_model_len=2048, enable_prefix_caching=False)
    engines = {}
    for name, config in (("plain", None), ("eagle", {"method": "eagle"})):
        for which in ("old", "new"):
            llm = LLM(None, speculative_config=config, **common)
            if which == "old":
                llm.engine.runner.backend = Old()
            engines[f"{name}-{which}"] = llm
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    ids = encode(engines["plain-new"], load_prompts("heldout"), args.max_tokens, 2048)
    warm_up(engines, max(c for c, _ in pairs), params)
    for c, n in pairs:
        ab_level(engines, ids, c, n, params, "plain-old", "plain-new")


if __name__ == "__main__":
    main()
