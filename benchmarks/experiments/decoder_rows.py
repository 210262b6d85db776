"""One request's step of n rows (a decode and its drafts) after --context tokens, the default
model's layers run one by one from Python against one C call (specserve/kernels/cpu/decoder.c),
alternating per repetition on one runner; the bits of both compared.

    python benchmarks/experiments/decoder_rows.py [--rows 1 2 4 8 16] [--context 128] [--reps 30]
        [--quantization none|int8|gguf]

Prints, per row count, the median ms of `runner.execute` each way and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--quantization", default="none", choices=["none", "int8", "gguf"])
    args = p.parse_args()
    import torch

    from specserve.config import DEFAULT_MODEL, CacheConfig, ModelConfig
    from specserve.kv_cache.manager import KVCacheManager
    from specserve.model.arch import ModelArch
    from specserve.model.loader import resolve_model_dir
    from specserve.model.runner import ModelRunner
    from specserve.request import Request, SamplingParams
    from specserve.scheduler.scheduler import SchedulerOutput

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    runner = ModelRunner(model_dir, ModelArch.from_dir(model_dir), ModelConfig(quantization=args.quantization),
                         CacheConfig(num_blocks=256), 4096)
    kv = KVCacheManager(256, runner.block_size, enable_prefix_caching=False)
    fused = runner.model.decoder
    assert fused is not None, "no C decoder for this model here"
    print(f"{'rows':>5} {'layers ms':>10} {'one call ms':>12} {'ratio':>6}  same bits")
    for rows in args.rows:
        req = Request("r", [(7 * j) % 1000 + 1 for j in range(args.context + 1)], SamplingParams(), set(), 0)
        kv.allocate(req, args.context + rows)
        runner.execute(SchedulerOutput([req], [args.context], [0]))
        req.num_computed_tokens = args.context
        req.spec_token_ids = list(range(5, 4 + rows))
        sched = SchedulerOutput([req], [rows], [rows - 1])
        times: dict[str, list[float]] = {"layers": [], "c": []}
        outs = {}
        for rep in range(args.reps + 2):
            for name, path in (("layers", None), ("c", fused)):
                runner.model.decoder = path
                start = time.perf_counter()
                step = runner.execute(sched)
                if rep >= 2:  # (two warm-up rounds)
                    times[name].append(time.perf_counter() - start)
                outs[name] = step.logits.clone()
        runner.model.decoder = fused
        a, b = (1e3 * statistics.median(times[k]) for k in ("layers", "c"))
        print(f"{rows:>5} {a:>10.2f} {b:>12.2f} {a / b:>6.2f}  {torch.equal(outs['layers'], outs['c'])}", flush=True)
        kv.free(req)


if __name__ == "__main__":
    main()
