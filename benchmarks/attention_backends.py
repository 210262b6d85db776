"""One target step of the default model on two attention backends, alternating in one process.

    python benchmarks/attention_backends.py [--backends torch cpu] [--dtype float32] [--reps 7]

Each backend gets its own engine (SPECSERVE_ATTENTION_BACKEND set while it loads); every shape
(requests x context x rows each) is timed on each in turn, `--reps` times, with
cost_model._time_step (the engine's own step-cost probe), and the medians are printed as a
markdown table with the ratio of the second backend to the first. Alternating keeps a drifting
machine from favouring either side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = ((1, 200, 1), (1, 1000, 1), (1, 300, 8), (1, 1000, 8), (8, 300, 1), (16, 300, 1), (16, 300, 4),
          (64, 200, 1), (64, 600, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs=2, default=["torch", "cpu"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    from specserve import LLM
    from specserve.spec_decode import cost_model as C

    engines = {}
    for name in args.backends:
        os.environ["SPECSERVE_ATTENTION_BACKEND"] = name
        engines[name] = LLM(speculative_config=None, max_num_seqs=64, max_model_len=2048, dtype=args.dtype,
                            enable_prefix_caching=False).engine
        print(f"{name}: {type(engines[name].runner.backend).__name__}", flush=True)
    first, second = args.backends
    print(f"| requests | context | rows each | {first} ms | {second} ms | {second} / {first} |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch, context, rows in SHAPES:
        C.CALIBRATION_CONTEXT = context
        times = {name: [] for name in engines}
        for e in engines.values():
            C._time_step(e.runner, e.kv, batch, rows, reps=1)  # warm-up
        for _ in range(args.reps):
            for name, e in engines.items():
                times[name].append(C._time_step(e.runner, e.kv, batch, rows, reps=1))
        a, b = (statistics.median(times[n]) for n in args.backends)
        print(f"| {batch} | {context} | {rows} | {1e3 * a:.1f} | {1e3 * b:.1f} | {b / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
