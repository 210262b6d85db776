"""Whether a prompt's prefill should go through SDPA or our paged kernel on the CPU: one
request's whole prefill (products included) of the default model with each attention backend
swapped into the same runner, side by side, best of --repeats; and whether each gives the
prompt's rows the same bits when the prompt comes in chunks of 37 (the kernel must: a row's
result depends on its own keys only).

    python benchmarks/experiments/prefill_attention.py [--tokens 64 256 1024 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import torch

    from specserve import LLM
    from specserve.model.attention import CPUPagedAttention, TorchAttention
    from specserve.request import Request, SamplingParams
    from specserve.scheduler.scheduler import SchedulerOutput

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024, 2048])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    llm = LLM(None, speculative_config=None, enable_prefix_caching=False, max_model_len=max(args.tokens) + 64,
              num_blocks=max(args.tokens) // 16 + 64)
    runner, kv = llm.engine.runner, llm.engine.kv
    backends = {"sdpa": TorchAttention(), "kernel": CPUPagedAttention()}

    def prefill(n: int, chunk: int | None = None) -> tuple[float, torch.Tensor]:
        req = Request("prefill", [7 + i % 500 for i in range(n)], SamplingParams(), set(), 0)
        kv.allocate(req, n)
        try:
            start, out = time.perf_counter(), []
            for s in range(0, n, chunk or n):
                req.num_computed_tokens = s
                step = runner.execute(SchedulerOutput([req], [min(chunk or n, n - s)], [0]))
                out.append(step.all_hidden.clone())
            return time.perf_counter() - start, torch.cat(out)
        finally:
            kv.free(req)

    print(f"{'tokens':>7}{'sdpa ms':>10}{'kernel ms':>11}{'sdpa/kernel':>13}  same bits in chunks of 37")
    for n in args.tokens:
        best, same = {}, {}
        for _ in range(args.repeats):
            for name, backend in backends.items():
                runner.backend = backend
                best[name] = min(best.get(name, float("inf")), prefill(n)[0])
        for name, backend in backends.items():
            runner.backend = backend
            same[name] = torch.equal(prefill(n)[1], prefill(n, 37)[1])
        print(f"{n:>7}{1e3 * best['sdpa']:>10.0f}{1e3 * best['kernel']:>11.0f}{best['sdpa'] / best['kernel']:>12.2f}x"
              f"  sdpa {same['sdpa']}, kernel {same['kernel']}", flush=True)


if __name__ == "__main__":
    main()
