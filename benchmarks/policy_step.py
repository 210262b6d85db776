"""The draft-budget policy's own host time per step: what `SpecPolicy` costs the engine thread
when every request brings drafts, apart from any model (on a GPU at 64 in flight a step's
forward is a few milliseconds, and this work is paid on top of it every step).

For B requests each with a lookup chain of N nodes (or an 8-node scored tree, --trees), one
step's policy work is timed: the values of every request's nodes, the selection of the rows to
verify (with the fairness check), and learning from each request's verify result. The least
of --repeats steps counts (noise on a shared machine only adds time).

    python benchmarks/policy_step.py [--batch 1 16 64] [--nodes 8] [--trees] [--repeats 50]

Runs against whichever specserve is importable (PYTHONPATH=../other-checkout to compare).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def step_ms(batch: int, nodes: int, trees: bool, repeats: int) -> float:
    from specserve.spec_decode.cost_model import StepCostModel
    from specserve.spec_decode.draft_tree import DraftTree
    from specserve.spec_decode.policy import SpecPolicy

    # rows nearly free against a plain step (as on a GPU), so that the selection keeps rows
    cost = StepCostModel({1: 0.001, 8: 0.0011, 64: 0.002}, 0.00001, {16: 0.0015})
    policy = SpecPolicy(cost, max(nodes, 8))
    states = [policy.new_state() for _ in range(batch)]
    rng = random.Random(0)
    best = float("inf")
    for _ in range(repeats):
        if trees:  # a head's tree: scored nodes, the lookup chain grafted on its first path
            drafts = [DraftTree([rng.randrange(9) for _ in range(8)], [-1, 0, 1, 2, -1, 4, 0, 6], None,
                                [-0.1 * (i + 1) for i in range(8)]) for _ in range(batch)]
            chains = [[0, 1] for _ in range(batch)]
        else:
            drafts = [DraftTree.chain([rng.randrange(9) for _ in range(nodes)], scores=[None] * nodes)
                      for _ in range(batch)]
            chains = [list(range(nodes)) for _ in range(batch)]
        start = time.perf_counter()
        values = []
        for state, tree, chain in zip(states, drafts, chains):
            state.chain_nodes = chain
            values.append(policy.values(state, tree))
        policy.select(batch, drafts, values, [False] * batch, 4096, [s.ahead for s in states], 0.0)
        for state, tree, chain in zip(states, drafts, chains):
            accepted = rng.randint(0, 3 if trees else len(tree))
            path = ([0, 1, 2, 3][:accepted]) if trees else list(range(accepted))
            policy.observe(state, tree, path, chain)
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--nodes", type=int, default=8, help="lookup chain length per request")
    ap.add_argument("--trees", action="store_true", help="8-node scored trees instead of lookup chains")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    kind = "8-node trees" if args.trees else f"{args.nodes}-node lookup chains"
    for batch in args.batch:
        ms = step_ms(batch, args.nodes, args.trees, args.repeats)
        print(f"B={batch:<4} {kind}: {ms:.3f} ms a step ({1e3 * ms / batch:.1f} us a request)", flush=True)


if __name__ == "__main__":
    main()
