"""Where a speculative decode step's time goes, in the engine: the target forward (by the
number of rows it verifies), drafting (`propose`) and verification (`sample_and_verify`), per
decode step, against plain decoding, on a few Spec-Bench prompts at batch 1.

    python benchmarks/step_breakdown.py [--category mt_bench] [--limit 3] [--max-tokens 128] \\
        [--config NAME=JSON ...] [--quantization none|int8|gguf]     # default: one config, {"method": "eagle"}

Each config is a speculative_config; e.g. --config 'p0={"method": "eagle", "min_draft_prob": 0}'.
"""

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._runner import timed  # noqa: E402


def measure(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    from specserve import SamplingParams

    engine = llm.engine
    acc: dict = defaultdict(float)
    by_rows: dict[int, list[float]] = defaultdict(list)
    execute = engine.runner.execute

    def timed_execute(sched, tree_parents=None):
        start = time.perf_counter()
        out = execute(sched, tree_parents)
        if sched.decode_only:
            seconds = time.perf_counter() - start
            acc["forward"] += seconds
            acc["steps"] += 1
            acc["rows"] += sched.total_tokens
            by_rows[sched.total_tokens].append(seconds)
        return out

    engine.runner.execute = timed_execute
    if engine.spec is not None:
        engine.spec.propose = timed(acc, "propose", engine.spec.propose)
        engine.spec.sample_and_verify = timed(acc, "verify", engine.spec.sample_and_verify)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    # warm-up on a prompt none measured shares (suffix decoding's corpus keeps what it answered)
    llm.generate({"prompt_token_ids": prompts[0][::-1]}, params)
    acc.clear()
    by_rows.clear()
    tokens, decode_s = 0, 0.0
    for ids in prompts:
        result = llm.generate({"prompt_token_ids": ids}, params)[0]
        tokens += len(result.outputs[0].token_ids) - 1
        decode_s += result.finished_time - result.first_token_time
    steps = max(1.0, acc["steps"])
    return {"ms_per_step": 1e3 * decode_s / steps, "tokens_per_step": tokens / steps,
            "forward_ms": 1e3 * acc["forward"] / steps, "rows_per_step": acc["rows"] / steps,
            "propose_ms": 1e3 * acc["propose"] / steps, "verify_ms": 1e3 * acc["verify"] / steps,
            "tokens_per_s": tokens / decode_s if decode_s else 0.0,
            "forward_ms_by_rows": {r: 1e3 * statistics.median(v) for r, v in sorted(by_rows.items())}}


def main() -> None:
    from specserve import LLM
    from specserve.bench.spec import load_prompts, named_configs
    from specserve.config import DEFAULT_MODEL, QUANTIZATION_CHOICES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--category", default="mt_bench")
    p.add_argument("--limit", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--config", action="append", default=[], metavar="NAME=JSON")
    p.add_argument("--quantization", default="none", choices=list(QUANTIZATION_CHOICES))
    args = p.parse_args()
    configs = [("none", None), *named_configs(args.config or ['eagle={"method": "eagle"}'], "--config")]
    rows = []
    for name, config in configs:  # one engine at a time: the others' memory is freed
        llm = LLM(DEFAULT_MODEL, max_model_len=4096, speculative_config=config, quantization=args.quantization)
        prompts = [llm.apply_chat_template([{"role": "user", "content": t}])
                   for _, t in load_prompts([args.category], args.limit)]
        rows.append((name, measure(llm, prompts, args.max_tokens)))
        del llm
    base = rows[0][1]["tokens_per_s"]
    print(f"{args.category}, {args.limit} prompts, {args.max_tokens} tokens, batch 1; per decode step:")
    print(f"{'config':<10}{'ms':>7}{'forward':>9}{'rows':>6}{'propose':>9}{'verify':>8}{'tokens':>8}{'speedup':>9}")
    for name, r in rows:
        print(f"{name:<10}{r['ms_per_step']:>7.1f}{r['forward_ms']:>9.1f}{r['rows_per_step']:>6.2f}"
              f"{r['propose_ms']:>9.1f}{r['verify_ms']:>8.1f}{r['tokens_per_step']:>8.2f}"
              f"{r['tokens_per_s'] / base:>8.2f}x")
    for name, r in rows:
        print(f"{name}: forward ms by rows: " + "  ".join(f"{k}: {v:.1f}" for k, v in r["forward_ms_by_rows"].items()))


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # a malformed --config or speculative_config
        sys.exit(f"step_breakdown: error: {e}")
