"""Where a plain decode step's milliseconds go: torch.profiler over engine steps.

B requests of a fixed prompt (about --context tokens) are prefilled, then --steps decode-only
steps of the engine (no speculation) are profiled. Each CPU op's self time goes to a class:

  gemm        aten::mm / addmm / bmm / linear's products (weights read here), and our
              linear kernel's calls (every weight format: a specserve::cpu_linear range)
  attention   scaled_dot_product_attention, our paged attention kernel and the KV gather /
              write of the backend
  small ops   every other ATen op (norms, rotary, activations, copies, views, indexing, cat)
  sampling    argmax / softmax / topk / sort / multinomial and the logits' own ops
  layers      the C decoder's one call for every layer (specserve/kernels/cpu/decoder.c: their
              products, attention and small ops together); --layer-by-layer splits it up
  python      the step's wall time minus every op's self time: interpreter, module calls,
              metadata built in Python, scheduling, detokenizing

    python benchmarks/profile_step.py [--batch 1 16] [--dtype float32] [--quantization none]
        [--context 128] [--steps 8] [--model NAME] [--top 12] [--json OUT.json] [--layer-by-layer]

Prints, per batch size, ms per step and share by class, and the top ops by self time.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GEMM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::_weight_int8pack_mm",
        "specserve::cpu_linear")
ATTENTION = ("scaled_dot_product", "attention", "aten::index_select", "aten::index_copy_", "aten::index_put_",
             "aten::gather", "aten::scatter")
SAMPLING = ("specserve::argmax", "aten::argmax", "aten::softmax", "aten::_softmax", "aten::log_softmax",
            "aten::_log_softmax", "aten::topk", "aten::sort", "aten::multinomial", "aten::max")


def name_kernels() -> None:
    """Our C kernels are no ATen ops: give their calls named ranges, so that their time is
    counted as products, attention or small ops rather than as Python."""
    import torch

    from specserve.kernels.cpu import cpu_attention, cpu_linear, decoder, layer_ops

    def named(fn, label):
        def call(*args, **kwargs):
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)
        return call

    cpu_linear._Packed.__call__ = named(cpu_linear._Packed.__call__, "specserve::cpu_linear")
    decoder.Decoder.__call__ = named(decoder.Decoder.__call__, "specserve::decoder")
    cpu_attention.paged_attention = named(cpu_attention.paged_attention, "specserve::paged_attention")
    for op in ("rms_norm", "rotary_", "silu_mul", "argmax"):
        setattr(layer_ops, op, named(getattr(layer_ops, op), f"specserve::{op}"))


def classify(name: str) -> str:
    if name == "specserve::decoder":
        return "layers"
    if name.startswith(GEMM):
        return "gemm"
    if any(k in name for k in ATTENTION):
        return "attention"
    if name.startswith(SAMPLING):
        return "sampling"
    return "small ops"


def profile(llm, batch: int, context: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from specserve import SamplingParams

    engine = llm.engine
    words = ("the quick brown fox jumps over the lazy dog while a slow green turtle walks "
             "along the river bank ").split()
    text = " ".join(words[i % len(words)] for i in range(context))
    ids = llm.get_tokenizer().encode(text)[:context]
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for b in range(batch):
        engine.add_request(f"p{batch}-{b}", ids, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.num_waiting:
        engine.step()
    engine.step()  # one decode step unprofiled (first touches)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    by_class: dict[str, float] = collections.defaultdict(float)
    by_op: dict[str, float] = collections.defaultdict(float)
    for evt in prof.key_averages():
        if not evt.key.startswith(("aten::", "specserve::")) and "attention" not in evt.key:
            continue  # module / record_function ranges: their ops are counted themselves
        by_class[classify(evt.key)] += evt.self_cpu_time_total / 1e6
        by_op[evt.key] += evt.self_cpu_time_total / 1e6
    # the profiler's own overhead inflates op times a little; python is what the ops leave
    ops = sum(by_class.values())
    by_class["python"] = max(0.0, wall - ops)
    return {"batch": batch, "step_ms": 1e3 * wall / steps,
            "classes_ms": {k: 1e3 * v / steps for k, v in by_class.items()},
            "top_ops_ms": {k: 1e3 * v / steps for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:40]}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "gguf"])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--model", default=None)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json", default=None)
    p.add_argument("--layer-by-layer", action="store_true",
                   help="the layers called one by one from Python (the C decoder off), to split its time up")
    args = p.parse_args()
    from specserve import LLM

    llm = LLM(args.model, dtype=args.dtype, speculative_config=None, max_num_seqs=max(args.batch),
              enable_prefix_caching=False, quantization=args.quantization)
    if args.layer_by_layer:
        llm.engine.runner.model.decoder = None
    name_kernels()
    results = []
    for b in args.batch:
        r = profile(llm, b, args.context, args.steps)
        results.append({"dtype": args.dtype, "quantization": args.quantization,
                        "layer_by_layer": args.layer_by_layer, **r})
        weights = args.dtype + ("" if args.quantization == "none" else f" {args.quantization}")
        print(f"\nbatch {b}, {weights}: {r['step_ms']:.1f} ms per decode step "
              f"({1e3 * b / r['step_ms']:.1f} tok/s)")
        for k, v in sorted(r["classes_ms"].items(), key=lambda kv: -kv[1]):
            print(f"  {k:<10} {v:7.2f} ms  {100 * v / r['step_ms']:5.1f}%")
        print("  top ops: " + ", ".join(f"{k} {v:.2f}" for k, v in list(r["top_ops_ms"].items())[:args.top]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
