"""One engine step that mixes a prefill chunk with decodes, against each part alone, and
against the same step with every query padded to the longest (the split turned off).

    python benchmarks/experiments/mixed_step.py [--decodes 48 --context 120 --prefill 400]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import torch

    from benchmarks._runner import default_runner
    import specserve.model.attention.gathered as gathered
    from specserve.request import Request, SamplingParams
    from specserve.scheduler.scheduler import SchedulerOutput

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decodes", type=int, default=48)
    p.add_argument("--context", type=int, default=120)
    p.add_argument("--prefill", type=int, default=400)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    runner, kv = default_runner(2048)
    g = torch.Generator().manual_seed(0)

    def request(rid: str, n: int) -> Request:
        return Request(rid, torch.randint(0, 40000, (n,), generator=g).tolist(), SamplingParams(), set(), 0)

    decodes = [request(f"d{i}", args.context) for i in range(args.decodes)]
    for r in decodes:
        kv.allocate(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens - 1
    prefill = request("p", args.prefill)
    kv.allocate(prefill, args.prefill)

    def best(reqs, counts, runs):
        sched = SchedulerOutput(reqs, counts, [0] * len(reqs))
        times = []
        for _ in range(runs + 1):  # the first run warms up
            start = time.perf_counter()
            runner.execute(sched)
            times.append(time.perf_counter() - start)
        return 1e3 * min(times[1:])

    ones = [1] * len(decodes)
    rows = [(f"{args.decodes} decodes", best(decodes, ones, args.runs)),
            (f"{args.prefill}-token prefill", best([prefill], [args.prefill], args.runs)),
            ("both in one step, split", best(decodes + [prefill], ones + [args.prefill], args.runs))]
    gathered.split_by_query_len = lambda qlen: None  # the name build_in_parts looks up
    rows.append(("both in one step, padded", best(decodes + [prefill], ones + [args.prefill], 1)))
    for name, ms in rows:
        print(f"{name:<32}{ms:>10.0f} ms")


if __name__ == "__main__":
    main()
