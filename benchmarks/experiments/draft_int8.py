"""What weight-only int8 buys an EAGLE head on this machine: each of the shipped head's matrix
products in the model's dtype against int8 (specserve.model.quant) at a few row counts, then
whole EAGLE-2 proposals (the head pass over the last step's committed tokens, then the tree's
passes) with the two heads alternating, and how often their drafts agree.

    python benchmarks/experiments/draft_int8.py [--context 300] [--rows 1 2 4 8 16] [--runs 30]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def best_us(fn, runs: int, inner: int = 20) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best * 1e6


def layer_table(full, int8, lm_weight, rows: list[int], runs: int) -> None:
    """Each product of the head as drafting runs it (DraftPass: q/k/v and gate/up fused): full
    precision (full's weights; lm_weight [V', hidden] for the LM head) against int8's."""
    import torch
    import torch.nn.functional as F

    from specserve.model.quant import Int8Linear

    layer = full.head.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    dense = {"fc": full.head.fc.weight,
             "qkv_proj": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
             "o_proj": attn.o_proj.weight, "gate_up_proj": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
             "down_proj": mlp.down_proj.weight, "lm_head": lm_weight}
    d = int8.draft
    quantized = {"fc": d.fc, "qkv_proj": d.qkv, "o_proj": d.o, "gate_up_proj": d.gate_up, "down_proj": d.down,
                 "lm_head": int8._lm_head}
    print(f"{'product':<13}{'in x out':>13}" + "".join(f"{r:>8} row{'s' if r > 1 else ' '}" for r in rows))
    for name, q in quantized.items():
        assert isinstance(q, Int8Linear)
        weight = dense[name].detach()
        out_f, in_f = weight.shape
        cells = []
        for r in rows:
            x = torch.randn(r, in_f, dtype=weight.dtype)
            cells.append(f"{best_us(lambda: F.linear(x, weight), runs):5.0f}/{best_us(lambda: q(x), runs):<5.0f}")
        print(f"{name:<13}{f'{in_f}x{out_f}':>13}" + "".join(f"{c:>13}" for c in cells))
    print(f"(µs, model dtype / int8 ({'own kernel' if q.own_kernel else 'torch'}); best of runs)")


def main() -> None:
    import torch

    from benchmarks._runner import default_runner, prompt_features
    from specserve.request import Request, SamplingParams
    from specserve.spec_decode.draft_tree import ProposeBatch
    from specserve.spec_decode.eagle import EagleProposer
    from specserve.spec_decode.quant import INT8_ALWAYS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=300, help="committed tokens the head has seen")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--redo", type=int, default=3, help="committed tokens each proposal's first pass covers")
    p.add_argument("--m", type=int, default=8)
    args = p.parse_args()
    runner, kv = default_runner(args.context // 16 + 8)
    heads = {name: EagleProposer(runner.model, num_speculative_tokens=args.m, depth=4, topk=2, quantize=q)
             for name, q in (("full", 0), ("int8", INT8_ALWAYS))}
    print(f"{runner.dtype}, {torch.get_num_threads()} threads, context {args.context}")
    full = heads["full"]
    lm_weight = runner.model.lm_head.weight
    layer_table(full, heads["int8"], lm_weight if full.d2t is None else lm_weight.index_select(0, full.d2t),
                args.rows, args.runs)

    g = torch.Generator().manual_seed(0)
    req = Request("r", torch.randint(0, 40000, (args.context,), generator=g).tolist(), SamplingParams(), set(), 0)

    hidden = prompt_features(runner, kv, req)
    req.all_token_ids.append(0)  # the pending token
    rid, k = req.request_id, len(hidden) - args.redo

    def batch_of(tokens: list[int]) -> ProposeBatch:
        return ProposeBatch([rid], [tokens], [args.m], -float("inf"), [req.params], [0], [req.block_ids],
                            [req.num_computed_tokens])

    def run_all_but_redo(prop) -> None:
        """The head has run the prompt's pairs but the last `redo` (a proposal a step earlier,
        untimed), and has been shown the features of those `redo`."""
        prop.free(rid)
        prop.observe([rid], [0], [k], hidden[:k])
        prop.propose(batch_of(req.all_token_ids[:k + 1]))
        prop.observe([rid], [k], [args.redo], hidden[k:])

    batch = batch_of(req.all_token_ids)
    times = {name: float("inf") for name in heads}
    trees = {}
    for _ in range(args.runs):
        for name, prop in heads.items():
            run_all_but_redo(prop)  # the timed pass covers `redo` committed tokens
            start = time.perf_counter()
            trees[name] = prop.propose(batch)[0]
            times[name] = min(times[name], time.perf_counter() - start)
    full, int8 = trees["full"], trees["int8"]
    same = sum(a == b for a, b in zip(full.tokens, int8.tokens)) if full and int8 else 0
    print(f"proposal (m {args.m}, depth 4, top-2): {times['full'] * 1e3:.2f} ms -> {times['int8'] * 1e3:.2f} ms "
          f"int8 ({times['full'] / times['int8']:.2f}x); nodes {len(full or [])} / {len(int8 or [])}, "
          f"same token at {same}")
    kv.free(req)


if __name__ == "__main__":
    main()
