"""What a verify step costs as it grows: one request's target forward with 1 token (a plain
decode step) against the same step verifying k draft nodes (a chain, or an EAGLE-like tree of
top-2 branches), for the default model on this machine, with a timed split of attention and
the LM head. Tree methods pay for every verified row; on a CPU that sets how many nodes a
tree should hold (speculative_config min_draft_prob, num_speculative_tokens).

    python benchmarks/experiments/verify_rows.py [--context 300] [--rows 0 2 4 8 12 16] [--runs 7]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import torch

    from benchmarks._runner import default_runner, timed
    from specserve.request import Request, SamplingParams
    from specserve.scheduler.scheduler import SchedulerOutput

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rows", type=int, nargs="+", default=[0, 2, 4, 8, 12, 16])
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args()
    runner, kv = default_runner(256)
    g = torch.Generator().manual_seed(0)
    req = Request("r", torch.randint(0, 40000, (args.context,), generator=g).tolist(), SamplingParams(), set(), 0)
    kv.allocate(req, args.context + max(args.rows))
    req.num_computed_tokens = args.context - 1
    req.spec_token_ids = torch.randint(0, 40000, (max(args.rows),), generator=g).tolist()

    timers: dict[str, float] = {}
    backend = runner.backend
    backend_call = type(backend).__call__
    type(backend).__call__ = timed(timers, "attention", backend_call)
    runner.model.compute_logits = timed(timers, "lm_head", runner.model.compute_logits)

    def step(k: int, tree: bool):
        parents = None
        if tree and k:  # root, then nodes whose parent is (i - 1) // 2: a binary tree, top-2 wide
            parents = [[-1] + [(i - 1) // 2 for i in range(1, k + 1)]]
        sched = SchedulerOutput([req], [k + 1], [k])
        best = None
        for i in range(args.runs + 1):  # the first run warms up
            timers.clear()
            start = time.perf_counter()
            runner.execute(sched, parents)
            total = time.perf_counter() - start
            if i and (best is None or total < best[0]):
                best = (total, dict(timers))
        return best

    print(f"{runner.backend.__class__.__name__}, {runner.dtype}, context {args.context}, "
          f"{torch.get_num_threads()} threads, best of {args.runs}")
    print(f"{'step':<18}{'ms':>8}{'x decode':>10}{'attention':>11}{'lm head':>9}")
    base = None
    for k in args.rows:
        for tree in ([False, True] if k > 1 else [False]):
            total, t = step(k, tree)
            base = base or total
            name = "decode" if k == 0 else f"{'tree' if tree else 'chain'} {k} nodes"
            print(f"{name:<18}{1e3 * total:>8.1f}{total / base:>10.2f}"
                  f"{1e3 * t.get('attention', 0):>11.1f}{1e3 * t.get('lm_head', 0):>9.1f}")
    kv.free(req)


if __name__ == "__main__":
    main()
