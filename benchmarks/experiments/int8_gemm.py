"""The target's products at a few row counts: float32 GEMMs against int8 weights through our
kernel (specserve.kernels.cpu.cpu_linear), for one decode step of a model's shapes (every layer's
QKV, O, gate-up and down products plus the LM head), with the two alternating.

    python benchmarks/experiments/int8_gemm.py [--rows 1 2 4 8 16 64 256] [--runs 5] [--layers 30]
        [--hidden 576] [--intermediate 1536] [--kv 192] [--vocab 49152]

The defaults are the default model's shapes (SmolLM2-135M). Prints ms per step for each row
count, the ratio, and whether every row's output is the same whatever the batch around it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import torch
    import torch.nn.functional as F

    from specserve.kernels.cpu import cpu_linear
    from specserve.model.quant import Int8Linear

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--kv", type=int, default=192, help="K (= V) projection width")
    p.add_argument("--vocab", type=int, default=49152)
    args = p.parse_args()
    if not cpu_linear.available():
        print(f"the int8 kernel cannot run here: {cpu_linear.why_unavailable()}")
        return
    h, i = args.hidden, args.intermediate
    shapes = [(h + 2 * args.kv, h), (h, h), (2 * i, h), (h, i)]
    torch.manual_seed(0)
    dense = [torch.randn(n, k) * 0.02 for n, k in shapes]
    quant = [Int8Linear(w, None) for w in dense]
    head = torch.randn(args.vocab, h) * 0.02
    head_t, head_q = head.t().contiguous(), Int8Linear(head, None)  # the float32 model's head layout
    xs = {k: torch.randn(max(args.rows), k) for k in {h, i}}

    def step_fp32(m: int) -> None:
        for _ in range(args.layers):
            for w in dense:
                F.linear(xs[w.shape[1]][:m], w)
        xs[h][:m] @ head_t

    def step_int8(m: int) -> None:
        for _ in range(args.layers):
            for q, w in zip(quant, dense):
                q(xs[w.shape[1]][:m])
        head_q(xs[h][:m])

    def best_ms(fn, m: int) -> float:
        fn(m)
        best = float("inf")
        for _ in range(args.runs):
            start = time.perf_counter()
            fn(m)
            best = min(best, time.perf_counter() - start)
        return best * 1e3

    print(f"{torch.get_num_threads()} threads; {args.layers} layers of {shapes} + LM head {args.vocab}x{h}")
    print(f"{'rows':>5} {'float32 ms':>11} {'int8 ms':>9} {'speed-up':>9}")
    for m in args.rows:
        fp32, int8 = best_ms(step_fp32, m), best_ms(step_int8, m)
        print(f"{m:>5} {fp32:>11.1f} {int8:>9.1f} {fp32 / int8:>8.2f}x", flush=True)
    x = xs[h][:max(args.rows)]
    full = head_q(x)
    same = all(torch.equal(head_q(x[s:s + m]), full[s:s + m]) for m in (1, 2, 3, 5, 7) for s in (0, 3))
    print(f"rows independent of the batch (LM head, 1-7 rows at two offsets): {same}")


if __name__ == "__main__":
    main()
