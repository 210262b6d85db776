"""`specserve bench spec`: speculative decoding over the Spec-Bench prompts, offline.

Greedy, batch 1, first turn of each prompt (chat template applied). For every prompt the
engines run back to back (no speculation, n-gram, and suffix decoding, a draft model, EAGLE or
Medusa when asked), so machine noise hits all of them alike.

`--workload agentic` runs instead specserve/data/agentic.jsonl: conversations of our own
(code edits, JSON edits, tool-call loops, text edits; half "dev", half "heldout", --split)
whose later turns repeat what earlier turns wrote, as agents and editors do. Every turn is one
request with the whole conversation so far, the assistant turns being plain decoding's
replies (every method gives the same, greedy output being lossless); categories are the
kinds. Reports per Spec-Bench category: tokens/s of
each engine, speedup over no speculation, and mean acceptance length (1 + accepted drafts per
verify step); checks that speculative outputs equal the plain ones token for token. Writes a
table to stdout and spec_bench.json + spec_bench.png into --out.

Categories follow Spec-Bench: the 80 MT-bench questions form "mt_bench"; translation,
summarization, qa, math_reasoning and rag have 80 prompts each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specserve.config import DTYPE_CHOICES, QUANTIZATION_CHOICES

CATEGORIES = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
AGENTIC_SPLITS = ("dev", "heldout", "all")
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def load_prompts(categories: list[str], limit: int | None, mt_bench_split: bool = False,
                 skip: int = 0) -> list[tuple[str, str]]:
    """(category, first turn) pairs, at most `limit` per category after its first `skip`, in
    file order. With mt_bench_split, MT-bench questions are reported (and limited) by their own
    sub-category, as "mt_bench/writing", "mt_bench/roleplay", ..."""
    text = resources.files("specserve").joinpath("data/spec_bench/question.jsonl").read_text()
    out, seen = [], {}
    for line in text.splitlines():
        q = json.loads(line)
        cat = "mt_bench" if q["category"] in MT_BENCH else q["category"]
        if cat not in categories:
            continue
        if cat == "mt_bench" and mt_bench_split:
            cat = f"mt_bench/{q['category']}"
        seen[cat] = seen.get(cat, 0) + 1
        if skip < seen[cat] and (limit is None or seen[cat] <= skip + limit):
            out.append((cat, q["turns"][0]))
    return out


def split_rows(name: str, split: str = "all") -> list[dict]:
    """The rows of specserve/data/<name> (JSON lines with a "split": dev or heldout) of one
    split ("all": every row), in file order."""
    if split not in AGENTIC_SPLITS:
        raise ValueError(f"--split: expected one of {', '.join(AGENTIC_SPLITS)}, got {split!r}")
    text = resources.files("specserve").joinpath(f"data/{name}").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r for r in rows if split == "all" or r["split"] == split]


def load_conversations(split: str = "all") -> list[dict]:
    """The agentic workload's conversations ({"id", "kind", "split", "system", "turns"})."""
    return split_rows("agentic.jsonl", split)


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None, help="target model (default: the default model)")
    parser.add_argument("--workload", choices=["spec_bench", "agentic"], default="spec_bench",
                        help="Spec-Bench's first turns, or our multi-turn agentic conversations")
    parser.add_argument("--split", choices=AGENTIC_SPLITS, default="all",
                        help="agentic: the conversations to run (heldout: never used for tuning)")
    parser.add_argument("--suffix", action="store_true", help="also run method suffix")
    parser.add_argument("--draft-model", default=None,
                        help="also run method draft_model with this draft (same vocabulary)")
    parser.add_argument("--eagle", nargs="?", const="default", default=None, metavar="HEAD_DIR",
                        help="also run method eagle (the shipped head for the default model, "
                             "or HEAD_DIR)")
    parser.add_argument("--tree-drafts", "--eagle-drafts", dest="tree_drafts", type=int, default=8,
                        help="eagle and medusa: draft tree size m (num_speculative_tokens)")
    parser.add_argument("--lookup-branch", type=int, default=None,
                        help="eagle and medusa: prompt-lookup chain grafted onto each tree (default: the decoder's)")
    parser.add_argument("--min-draft-prob", type=float, default=None,
                        help="eagle: cut tree nodes whose cumulative draft probability is below this")
    parser.add_argument("--eagle-variant", action="append", default=[], metavar="NAME=JSON",
                        help="also run eagle as 'eagle-NAME' with these speculative_config keys on top "
                             "(repeatable), e.g. p05='{\"min_draft_prob\": 0.05}'")
    parser.add_argument("--eagle-head-only", action="store_true",
                        help="also run eagle with lookup_branch 0 (as 'eagle-head-only'; same as "
                             "--eagle-variant 'head-only={\"lookup_branch\": 0}')")
    parser.add_argument("--medusa", default=None, metavar="HEADS_DIR",
                        help="also run method medusa with these heads")
    parser.add_argument("--category", action="append", choices=CATEGORIES, default=None,
                        help="categories to run (repeatable; default: all)")
    parser.add_argument("--mt-bench-split", action="store_true",
                        help="report MT-bench by its 8 sub-categories (--limit applies to each)")
    parser.add_argument("--limit", type=int, default=5, help="prompts per category")
    parser.add_argument("--skip", type=int, default=0,
                        help="skip each category's first N questions (e.g. --skip 5: questions "
                             "beyond those the defaults were measured on)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=5,
                        help="ngram and draft_model: draft length k")
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--no-adaptive", action="store_true", help="fixed draft length")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES),
                        help="weights and activations of every engine")
    parser.add_argument("--quantization", default="none", choices=list(QUANTIZATION_CHOICES),
                        help="every engine's target weights (int8: see `specserve serve --help`)")
    parser.add_argument("--out", default="bench_out/spec", help="directory for JSON and PNG")
    return parser


def named_configs(specs: list[str], option: str = "--eagle-variant") -> list[tuple[str, dict]]:
    """NAME=JSON option values -> [(name, keys)]; a malformed one is a clear error."""
    out = []
    for spec in specs:
        name, _, text = spec.partition("=")
        try:
            keys = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{option} {spec!r}: expected NAME=JSON ({e})") from None
        if not name or not isinstance(keys, dict):
            raise ValueError(f"{option} {spec!r}: expected NAME=JSON with a JSON object")
        out.append((name, keys))
    return out


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0  # after the first token: the part speculation speeds up
    decode_seconds: float = 0.0
    drafts: int = 0
    accepted: int = 0
    mismatches: int = 0

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def acceptance_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else 1.0


def build_engines(args: argparse.Namespace, variants: list[tuple[str, dict]]) -> dict:
    """The engines to compare, by method name: "none" is plain decoding (LLM's own default
    speculates), then ngram and whatever the options ask for."""
    from specserve import LLM

    common_engine = {"max_model_len": args.max_model_len, "dtype": args.dtype,
                     "quantization": args.quantization}
    engines = {"none": LLM(args.model, **common_engine, speculative_config=None)}
    common = {"num_speculative_tokens": args.num_speculative_tokens,
              "adaptive": not args.no_adaptive}
    engines["ngram"] = LLM(args.model, **common_engine, speculative_config={
        "method": "ngram", "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max, **common})
    if args.draft_model:
        engines["draft_model"] = LLM(args.model, **common_engine,
                                     speculative_config={"method": "draft_model",
                                                         "model": args.draft_model, **common})
    tree = {"num_speculative_tokens": args.tree_drafts, "adaptive": not args.no_adaptive,
            "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    if args.lookup_branch is not None:
        tree["lookup_branch"] = args.lookup_branch
    if args.eagle:
        eagle = {"method": "eagle", **tree}
        if args.eagle != "default":
            eagle["model"] = args.eagle
        if args.min_draft_prob is not None:
            eagle["min_draft_prob"] = args.min_draft_prob
        engines["eagle"] = LLM(args.model, **common_engine, speculative_config=eagle)
        for name, keys in variants:
            engines[f"eagle-{name}"] = LLM(args.model, **common_engine, speculative_config={**eagle, **keys})
    if args.medusa:
        engines["medusa"] = LLM(args.model, **common_engine,
                                speculative_config={"method": "medusa", "model": args.medusa, **tree})
    if args.suffix:
        engines["suffix"] = LLM(args.model, **common_engine, speculative_config={
            "method": "suffix", "adaptive": not args.no_adaptive,
            "prompt_lookup_min": args.prompt_lookup_min})
    return engines


def _run_turn(engines: dict, tallies: dict, ids: list[int], params) -> list[int]:
    """One prompt through every engine, back to back; returns plain decoding's tokens."""
    reference = None
    for method, llm in engines.items():
        stats = llm.engine.stats
        d0, a0 = stats.spec_num_drafts, stats.spec_num_accepted_tokens
        start = time.perf_counter()
        result = llm.generate({"prompt_token_ids": ids}, params)[0]
        elapsed = time.perf_counter() - start
        out = result.outputs[0]
        t = tallies[method]
        t.tokens += len(out.token_ids)
        t.seconds += elapsed
        t.decode_tokens += len(out.token_ids) - 1
        t.decode_seconds += result.finished_time - result.first_token_time
        t.drafts += stats.spec_num_drafts - d0
        t.accepted += stats.spec_num_accepted_tokens - a0
        if reference is None:
            reference = out.token_ids
        elif out.token_ids != reference:
            t.mismatches += 1
    return reference


def run_conversations(engines: dict, conversations, tallies_of, params, room: int) -> None:
    """Each conversation's turns in order through every engine (`_run_turn`), plain decoding's
    reply appended as the assistant's before the next turn; tallies_of(conversation) -> the
    tallies its turns count in. A prompt keeps its last `room` tokens."""
    template, tokenizer = engines["none"].apply_chat_template, engines["none"].engine.tokenizer
    for conv in conversations:
        messages = [{"role": "system", "content": conv["system"]}] if conv.get("system") else []
        for turn in conv["turns"]:
            messages.append({"role": "user", "content": turn})
            reply = _run_turn(engines, tallies_of(conv), template(messages)[-room:], params)
            messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from specserve import SamplingParams

    variants = named_configs(args.eagle_variant)  # checked before any model loads
    if args.eagle_head_only:
        variants.insert(0, ("head-only", {"lookup_branch": 0}))
    if variants and not args.eagle:
        raise ValueError("--eagle-variant and --eagle-head-only need --eagle")
    if args.min_draft_prob is not None and not args.eagle:  # options no engine would read
        raise ValueError("--min-draft-prob needs --eagle")
    if args.lookup_branch is not None and not (args.eagle or args.medusa):
        raise ValueError("--lookup-branch needs --eagle or --medusa")
    if args.skip < 0:
        raise ValueError(f"--skip: expected a count >= 0, got {args.skip}")
    if args.skip and args.workload == "agentic":
        raise ValueError("--skip applies to Spec-Bench's questions (agentic conversations: --split)")
    room = args.max_model_len - args.max_tokens - 8  # a prompt's tokens kept: room to generate
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    if args.workload == "agentic":
        conversations = load_conversations(args.split)
        categories = list(dict.fromkeys(c["kind"] for c in conversations))
        engines = build_engines(args, variants)
        tallies = {c: {m: Tally() for m in engines} for c in categories}
        run_conversations(engines, tqdm(conversations, desc="agentic bench", unit="conversation"),
                          lambda conv: tallies[conv["kind"]], params, room)
    else:
        categories = args.category or CATEGORIES
        if args.mt_bench_split and "mt_bench" not in categories:
            raise ValueError("--mt-bench-split needs the mt_bench category")
        prompts = load_prompts(categories, args.limit, args.mt_bench_split, args.skip)
        categories = list(dict.fromkeys(c for c, _ in prompts))  # as reported (sub-categories split)
        engines = build_engines(args, variants)
        tallies = {c: {m: Tally() for m in engines} for c in categories}
        for cat, turn in tqdm(prompts, desc="spec bench", unit="prompt"):
            ids = engines["none"].apply_chat_template([{"role": "user", "content": turn}])
            _run_turn(engines, tallies[cat], ids[-room:], params)
    result = _summarise(args, tallies, list(engines))
    result["dtype"] = str(engines["none"].engine.runner.dtype).removeprefix("torch.")  # what auto chose
    _print_table(result)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "spec_bench.json").write_text(json.dumps(result, indent=2))
    _plot(result, out_dir / "spec_bench.png")
    print(f"wrote {out_dir / 'spec_bench.json'} and {out_dir / 'spec_bench.png'}")
    return result


def _summarise(args, tallies, methods) -> dict:
    rows = []
    for cat, by_method in tallies.items():
        base, base_dec = by_method["none"].tps, by_method["none"].decode_tps
        for m in methods:
            t = by_method[m]
            rows.append({"category": cat, "method": m, "tokens": t.tokens,
                         "seconds": round(t.seconds, 3), "tokens_per_s": round(t.tps, 2),
                         "speedup_e2e": round(t.tps / base, 3) if base else None,
                         "decode_tokens_per_s": round(t.decode_tps, 2),
                         "speedup": round(t.decode_tps / base_dec, 3) if base_dec else None,
                         "mean_acceptance_length": round(t.acceptance_length, 3),
                         "mismatches": t.mismatches})
    totals = {}
    for m in methods:
        tok = sum(tallies[c][m].decode_tokens for c in tallies)
        sec = sum(tallies[c][m].decode_seconds for c in tallies)
        totals[m] = tok / sec if sec else 0.0
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()} "
            f"{platform.processor() or ''} ({os.cpu_count()} cpus)".strip(),
            "config": {k: v for k, v in vars(args).items() if k != "func"},
            "rows": rows,
            "overall": {m: {"decode_tokens_per_s": round(v, 2),
                            "speedup": round(v / totals["none"], 3) if totals["none"] else None}
                        for m, v in totals.items()}}


def _print_table(result: dict) -> None:
    cw = 2 + max(len("category"), *(len(r["category"]) for r in result["rows"]))
    mw = 2 + max(len("method"), *(len(m) for m in result["overall"]))
    print(f"{'category':<{cw}}{'method':<{mw}}{'e2e tok/s':>10}{'decode tok/s':>13}{'speedup':>9}"
          f"{'acc.len':>9}{'mismatch':>10}")
    for r in result["rows"]:
        print(f"{r['category']:<{cw}}{r['method']:<{mw}}{r['tokens_per_s']:>10.2f}"
              f"{r['decode_tokens_per_s']:>13.2f}{r['speedup']:>9.2f}"
              f"{r['mean_acceptance_length']:>9.2f}{r['mismatches']:>10}")
    for m, o in result["overall"].items():
        print(f"{'overall':<{cw}}{m:<{mw}}{'':>10}{o['decode_tokens_per_s']:>13.2f}{o['speedup']:>9.2f}")
    print("speedup: decode tokens/s (after the first token) over no speculation")


def _plot(result: dict, path: Path) -> None:
    cats = list(dict.fromkeys(r["category"] for r in result["rows"]))
    methods = [m for m in dict.fromkeys(r["method"] for r in result["rows"]) if m != "none"]
    series = {m: [next(r["speedup"] for r in result["rows"] if r["category"] == c and r["method"] == m)
                  for c in cats] for m in methods}
    workload = "agentic conversations" if result["config"].get("workload") == "agentic" else "Spec-Bench"
    grouped_bars(path, cats, series, "decode speedup over no speculation",
                 f"{workload}, greedy, batch 1 ({result['date']})", baseline=1.0, rotation=20)


def grouped_bars(path: Path, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str,
                 baseline: float | None = None, rotation: int = 0) -> None:
    """A PNG of one bar per series in each group (series: name -> a value per group)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(groups) + 2), 4))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=name)
    if baseline is not None:
        ax.axhline(baseline, color="gray", lw=1, ls="--")
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(groups))], groups, rotation=rotation)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    run(add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv))


if __name__ == "__main__":
    main()
