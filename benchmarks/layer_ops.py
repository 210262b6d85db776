"""Plain decoding with a layer's small ops in C (specserve/kernels/cpu/layer_ops.c) against PyTorch's.

One engine of the default model (no speculation); the fused norms and rotary embedding are
switched on and off between runs of the same greedy batch (order alternated), so both sides
share the process, the weights and the machine's state. Reports median tok/s per side and
whether the greedy outputs were identical.

    python benchmarks/layer_ops.py [--dtype float32] [--quantization none|int8] [--batch 1 16]
        [--max-tokens 64] [--repeats 4] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["Write a short story about a robot who learns to paint.",
           "Explain how a hash map works, with an example in Python."]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="none", choices=["none", "int8"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from specserve import LLM, SamplingParams
    from specserve.kernels.cpu import layer_ops
    from specserve.model.llama import RMSNorm

    if not layer_ops.available():
        sys.exit("layer_ops kernel unavailable here (needs x86 AVX2/FMA and a C compiler)")
    llm = LLM(dtype=args.dtype, quantization=None if args.quantization == "none" else args.quantization,
              speculative_config=None, max_num_seqs=max(args.batch))
    model = llm.engine.runner.model
    if not any(isinstance(m, RMSNorm) and m.fused for m in model.modules()):
        sys.exit(f"the fused ops are not used with dtype {args.dtype} on {llm.engine.runner.device}")

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for batch in args.batch:
        rates: dict[bool, list[float]] = {True: [], False: []}
        outputs: dict[bool, list] = {}
        for rep in range(args.repeats):
            for fused in ((True, False) if rep % 2 == 0 else (False, True)):
                model.use_layer_ops(fused)
                start = time.perf_counter()
                out = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(batch)], params)
                rates[fused].append(batch * args.max_tokens / (time.perf_counter() - start))
                outputs[fused] = [o.outputs[0].token_ids for o in out]
            print(f"  batch {batch}: round {rep + 1}/{args.repeats}", flush=True)
        c, t = statistics.median(rates[True]), statistics.median(rates[False])
        same = sum(a == b for a, b in zip(outputs[True], outputs[False]))
        rows.append({"batch": batch, "c_tok_s": c, "torch_tok_s": t, "speedup": c / t,
                     "identical": same, "requests": batch})
        print(f"batch {batch}: C ops {c:.1f} tok/s, PyTorch ops {t:.1f} tok/s, {c / t:.2f}x; "
              f"identical greedy outputs {same}/{batch}", flush=True)
    model.use_layer_ops(True)
    if args.json:
        Path(args.json).write_text(json.dumps({"dtype": args.dtype, "quantization": args.quantization,
                                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
