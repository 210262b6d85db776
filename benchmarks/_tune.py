"""What the kernel tuners (attention_tune.py, matmul_tune.py) share: the search over their
knobs and the command's frame (device check, JSON out)."""
from __future__ import annotations

import itertools
import json
import os
import sys
import time


def search(knobs: dict, start: dict, measure, score, mode: str, budget_s: float) -> None:
    """Try combinations of `knobs` (name -> candidate values) with measure(combo) -> row until
    budget_s runs out: "grid" every combination; "descent" from `start`, each round trying every
    other value of one knob at a time and keeping the best (score(row)) until a round finds
    nothing better."""
    t_end = time.monotonic() + budget_s
    if mode == "grid":
        for values in itertools.product(*knobs.values()):
            if time.monotonic() > t_end:
                print("[tune] time budget spent", flush=True)
                return
            measure(dict(zip(knobs, values)))
        return
    cur = dict(start)
    best = measure(cur)
    improved = True
    while improved and time.monotonic() < t_end:
        improved = False
        for name, values in knobs.items():
            for v in values:
                if v == cur[name] or time.monotonic() > t_end:
                    continue
                row = measure(dict(cur, **{name: v}))
                if score(row) > score(best):
                    best, cur, improved = row, dict(cur, **{name: v}), True
    if time.monotonic() >= t_end:
        print("[tune] time budget spent", flush=True)


def main(args, run, name: str) -> int:
    """Run a tuner (run(args) -> its results) on args.device and write OUT/<name>.json."""
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:
        import torch

        if not torch.cuda.is_available():
            print(f"{name}.py: no CUDA device (use --device cpu --quick for a smoke run)", file=sys.stderr)
            return 2
    results = run(args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    print(f"wrote {path}")
    return 0
