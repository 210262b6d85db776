"""Schema-constrained generation against unconstrained, plain and with speculation.

Usage: python benchmarks/structured.py [--batch 1 4] [--max-tokens 128] [--out DIR]

For each speculation setting (none, ngram, eagle) and batch size, the same chat prompts run
unconstrained and under a JSON schema (greedy); tokens/s of each, the ratio, and the grammar's
own time per step (masks of every verify row, the cut of forbidden drafts, the masking of the
logits), measured by wrapping the decoder's calls of structured.constrain and structured.cut. Greedy output with
speculation must equal greedy output without it (checked per setting against "none").
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specserve import LLM, SamplingParams
from specserve.spec_decode import decoder
from specserve.structured import StructuredOutput

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "items"],
          "properties": {"title": {"type": "string"},
                         "items": {"type": "array", "minItems": 3, "maxItems": 6, "items": {
                             "type": "object", "additionalProperties": False,
                             "required": ["name", "quantity", "note"],
                             "properties": {"name": {"type": "string"}, "quantity": {"type": "integer"},
                                            "note": {"type": "string"}}}}}}
PROMPTS = ["Write a shopping list for a picnic as JSON.",
           "List the parts of a bicycle with counts, as JSON.",
           "Plan a small garden: plants and how many of each, in JSON.",
           "Give the ingredients of a cake as JSON with quantities."]
CONFIGS = {"none": "none", "ngram": {"method": "ngram"}, "eagle": {"method": "eagle"}}


class GrammarClock:
    """Seconds spent in the decoder's grammar work, and the steps that did any."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        for name in ("constrain", "cut"):
            setattr(decoder, name, self._timed(getattr(decoder, name), name == "constrain"))

    def _timed(self, fn, counts_step: bool):
        clock = self

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - start
                clock.calls += counts_step
        return wrapper


def run(llm: LLM, batch: int, constraint: StructuredOutput | None, max_tokens: int):
    ids = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured=constraint)
    outs, tokens, start = [], 0, time.perf_counter()
    for i in range(0, len(ids), batch):
        for o in llm.generate(ids[i:i + batch], params):
            outs.append(o.outputs[0].token_ids)
            tokens += len(o.outputs[0].token_ids)
    return outs, tokens / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    clock = GrammarClock()
    constraint = StructuredOutput(json=json.dumps(SCHEMA))
    rows, reference = [], {}
    for name in args.configs:
        llm = LLM(speculative_config=CONFIGS[name])
        run(llm, 1, constraint, 8)  # warm-up: grammar engine, first compile
        for batch in args.batch:
            free_out, free_tps = run(llm, batch, None, args.max_tokens)
            clock.seconds, clock.calls = 0.0, 0
            json_out, json_tps = run(llm, batch, constraint, args.max_tokens)
            per_step = 1e3 * clock.seconds / max(1, clock.calls)
            same = reference.setdefault((batch, "free"), free_out) == free_out and \
                reference.setdefault((batch, "json"), json_out) == json_out
            rows.append({"config": name, "batch": batch, "free_tok_s": free_tps, "json_tok_s": json_tps,
                         "ratio": json_tps / free_tps, "grammar_ms_per_step": per_step,
                         "identical_to_none": same})
            print(f"{name:6s} batch {batch:2d}: unconstrained {free_tps:6.1f} tok/s, schema "
                  f"{json_tps:6.1f} tok/s ({json_tps / free_tps:.2f}x), grammar {per_step:.2f} ms/step, "
                  f"identical to none: {same}", flush=True)
        del llm
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "structured.json").write_text(json.dumps(rows, indent=2))
    return 0 if all(r["identical_to_none"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
