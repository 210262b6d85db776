"""`specserve bench load`: plain decoding vs speculation under load, offline.

Answers "is speculation ever slower than plain decoding, at any load?". The workload is
specserve/data/load_prompts.jsonl: 48 chat and code prompts written for this benchmark (not
Spec-Bench's, which the project tunes on), each kind half "dev" and half "heldout"; the
held-out half is for checking, never for tuning, and the result records which split ran.

At each concurrency level c the engine keeps exactly c requests in flight (a closed loop: when
one finishes, the next prompt is added) until --requests prompts have finished; the default is
max(2c, 8). The request list cycles through the prompts when it is longer than the prompt
list, so at c = 64 every prompt appears several times. Every method runs the identical list at
a level: plain decoding ("none", speculative_config=None) and each --config. Greedy, chat
template applied, prefix caching off so that every run prefills its prompts whatever ran
before it; with --prefix-caching on, as the server runs, each run starting from an empty
cache (a request then reuses what the run's earlier requests computed: an agentic turn, the
conversation before it). One engine per method, all loaded before anything is timed. The
methods run side by side: one engine step of each in turn, each run timing only its own
steps, so that a machine whose speed drifts by tens of percent within a minute (shared cloud
CPUs do) slows every method alike; --sequential runs them one after another instead, in an
order rotated from level to level. With --repeats N the median of N runs is reported.

Per (level, method): throughput (output tokens / seconds of its own steps, prefill included),
speedup over "none" at the same level, the decode speedup (the same over the steps without a
prefill chunk only: what speculation does to decoding, where long prompts make prefill much of
the time), mean acceptance length (1 + accepted / drafts) and mismatches (requests whose token
ids differ from plain decoding's; speculation is lossless, so 0). Every run's requests, and
each pass over the prompt list within a run, are a tenant of their own, so suffix decoding
(method or lookup "suffix") drafts from what the other prompts of the same run produced, never
from an earlier answer to the same prompt (which would make it look far better than on new
requests).
Writes a table to stdout and load.json + load.png into --out.

`--workload agentic` runs instead specserve/data/agentic.jsonl's conversations (code, JSON,
tool-call and text edits) as an agent sends them: each turn one request holding the
conversation so far, sent when the conversation's previous turn has finished, so that c is the
number of conversations in flight (a new one starts when one ends). The assistant turns are
plain decoding's greedy replies, computed once before the timed runs (every method's are the
same: speculation is lossless). --requests counts turns; the default is every turn of 2c
conversations, or of every conversation once where that is more, cycling through them.

Not measured: latency (TTFT, inter-token; see `specserve bench serve`), sampled decoding,
open-loop arrivals, the HTTP server.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from specserve.bench.spec import named_configs, split_rows
from specserve.config import DTYPE_CHOICES, QUANTIZATION_CHOICES, SpecConfig

DEFAULT_CONFIGS = ['ngram={"method": "ngram"}', 'eagle={"method": "eagle"}']
SPLITS = ("dev", "heldout", "all")
CPU_FLAGS = ("avx512_bf16", "amx_bf16", "avx2")


def load_prompts(split: str = "all") -> list[dict]:
    """The workload's rows ({"id", "kind", "split", "prompt"}) of one split, in file order."""
    return split_rows("load_prompts.jsonl", split)


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None, help="target model (default: the default model)")
    parser.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES),
                        help="weights and activations of every engine")
    parser.add_argument("--quantization", default="none", choices=list(QUANTIZATION_CHOICES),
                        help="every engine's target weights (int8: see `specserve serve --help`)")
    parser.add_argument("--config", action="append", default=None, metavar="NAME=JSON",
                        help="a speculative configuration to run as NAME (repeatable; default: "
                             + " and ".join(repr(c) for c in DEFAULT_CONFIGS) + ")")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64],
                        help="requests kept in flight, one level each")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests finished per level (default: max(2 * concurrency, 8); agentic: "
                             "the turns of max(2 * concurrency, all) conversations)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per method and level; the median throughput is reported")
    parser.add_argument("--sequential", action="store_true",
                        help="run the methods one after another (default: their steps alternate, "
                             "so that the machine's drift slows them alike)")
    parser.add_argument("--control", action="store_true",
                        help="also run a second plain engine ('none-2'): its ratio to 'none' is what two "
                             "identical engines differ by on this machine in this run (the noise floor)")
    parser.add_argument("--split", default="all", choices=SPLITS,
                        help="prompts to run (heldout: never used for tuning)")
    parser.add_argument("--workload", choices=["chat_code", "agentic"], default="chat_code",
                        help="single-turn chat and code prompts, or every turn of the agentic "
                             "conversations (edits that repeat earlier context)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="every engine with prefix caching on (the server's default), emptied at the "
                             "start of each run")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--out", default="bench_out/load", help="directory for JSON and PNG")
    return parser


def check_options(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """The methods' speculative configs [(name, keys)]; ValueError for bad input, before any
    model loads."""
    configs = named_configs(args.config or DEFAULT_CONFIGS, "--config")
    names = [name for name, _ in configs]
    if "none" in names or "none-2" in names:
        raise ValueError("--config: the names 'none' and 'none-2' are plain decoding; pick another")
    if len(set(names)) != len(names):
        raise ValueError(f"--config: names must be unique, got {', '.join(names)}")
    for name, keys in configs:
        if SpecConfig.parse(keys).method is None:
            raise ValueError(f"--config {name}: no speculative method (plain decoding runs as 'none')")
    if not args.concurrency or min(args.concurrency) < 1:
        raise ValueError(f"--concurrency: every level must be at least 1, got {args.concurrency}")
    if args.requests is not None and args.requests < max(args.concurrency):
        raise ValueError(f"--requests {args.requests}: below --concurrency {max(args.concurrency)}, "
                         "so that level would never have all its requests in flight")
    for option, value in (("--repeats", args.repeats), ("--max-tokens", args.max_tokens),
                          ("--max-model-len", args.max_model_len)):
        if value < 1:
            raise ValueError(f"{option}: must be at least 1, got {value}")
    return configs


def request_list(prompts: list, concurrency: int, requests: int | None) -> list:
    """The prompts one level runs, in order: max(2c, 8) unless given, cycling the list."""
    n = requests if requests is not None else max(2 * concurrency, 8)
    return [prompts[i % len(prompts)] for i in range(n)]


def conversation_list(turn_ids: list[list[list[int]]], concurrency: int,
                      requests: int | None) -> tuple[list[list[int]], list[int | None]]:
    """A level's agentic request list: the turns of max(2c, all of them) conversations unless
    `requests` turns are given, cycling through the conversations (`turn_ids`: each one's turns' prompt
    ids, in order), and for each request the index of the one it follows (its conversation's
    previous turn; None for a first turn)."""
    ids, after = [], []
    n = requests if requests is not None else sum(
        len(turn_ids[i % len(turn_ids)]) for i in range(max(2 * concurrency, len(turn_ids))))
    conv = 0
    while len(ids) < n:
        for turn, prompt in enumerate(turn_ids[conv % len(turn_ids)][:n - len(ids)]):
            after.append(len(ids) - 1 if turn else None)
            ids.append(prompt)
        conv += 1
    return ids, after


def rotated(methods: list[str], level: int) -> list[str]:
    """The run order at the level-th concurrency level: shifted by one per level."""
    k = level % len(methods)
    return methods[k:] + methods[:k]


def machine() -> dict:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    flags = set(cpuinfo.split())
    return {"platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "cpu_flags": [f for f in CPU_FLAGS if f in flags]}


@dataclass
class Run:
    """One closed-loop pass of a method over a level's request list."""

    tokens: int
    seconds: float
    drafts: int
    accepted: int
    preemptions: int
    outputs: list[list[int]] = field(repr=False)  # output token ids, in request-list order
    decode_tokens: int = 0  # tokens emitted by steps without a prefill chunk
    decode_seconds: float = 0.0  # and those steps' seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class ClosedLoop:
    """One method's pass over a level's request list, `concurrency` requests in flight (when
    one finishes the next prompt is added), advanced one engine step at a time. `after[i]`:
    the request that must finish before request i is sent (a conversation's previous turn),
    if any; the next sent is always the first of the list not sent whose turn it is. `seconds`
    counts only this loop's own work, so loops of several engines can alternate step by step
    on one machine and each still measures itself."""

    def __init__(self, engine, prompt_ids: list[list[int]], concurrency: int, params, tag: str,
                 after: list[int | None] | None = None) -> None:
        self.engine, self.prompt_ids, self.params, self.tag = engine, prompt_ids, params, tag
        self.concurrency = concurrency
        self.after = after or [None] * len(prompt_ids)
        self.in_flight = 0
        s = engine.stats
        self._before = (s.spec_num_drafts, s.spec_num_accepted_tokens, s.num_preemptions)
        self.outputs: list[list[int] | None] = [None] * len(prompt_ids)
        self.index: dict[str, int] = {}
        seen: dict[tuple, int] = {}
        self.passes = []  # per request: how many times its prompt came before it in the list
        for ids in prompt_ids:
            self.passes.append(seen.get(key := tuple(ids), 0))
            seen[key] = self.passes[-1] + 1
        self.seconds = self.decode_seconds = 0.0
        self.decode_tokens = 0
        engine.reset_prefix_cache()  # (caching on) nothing left from an earlier run or the warm-up
        self.waiting = list(range(len(prompt_ids)))  # not sent yet, in list order
        start = time.perf_counter()
        self._submit()
        self.seconds += time.perf_counter() - start

    def _submit(self) -> None:
        """Send the first requests of the list whose turn it is, up to `concurrency` in flight."""
        j = 0
        while self.in_flight < self.concurrency and j < len(self.waiting):
            i = self.waiting[j]
            if self.after[i] is not None and self.outputs[self.after[i]] is None:
                j += 1
                continue
            del self.waiting[j]
            self._send(i)

    def _send(self, i: int) -> None:
        self.in_flight += 1
        self.index[f"{self.tag}-{i}"] = i
        # a tenant per run and pass over the prompts: suffix decoding's corpus holds what other
        # prompts of this run produced, never an earlier answer to the same prompt
        self.engine.add_request(f"{self.tag}-{i}", self.prompt_ids[i], self.params,
                                tenant=f"{self.tag}-pass{self.passes[i]}")

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self) -> None:
        s = self.engine.stats
        decode_steps, emitted = s.num_decode_only_steps, s.generation_tokens_total
        start = time.perf_counter()
        finished = []
        for out in self.engine.step():
            if out.finished:
                self.outputs[self.index[out.request_id]] = list(out.outputs[0].token_ids)
                finished.append(out)
        elapsed = time.perf_counter() - start
        if s.num_decode_only_steps > decode_steps:  # every request decoding: no prefill in it
            self.decode_seconds += elapsed
            self.decode_tokens += s.generation_tokens_total - emitted
        start = time.perf_counter()
        if finished:
            self.in_flight -= len(finished)
            self._submit()
        self.seconds += elapsed + time.perf_counter() - start

    def result(self) -> Run:
        s = self.engine.stats
        drafts, accepted, preempted = (now - then for now, then in zip(
            (s.spec_num_drafts, s.spec_num_accepted_tokens, s.num_preemptions), self._before))
        return Run(tokens=sum(len(o) for o in self.outputs), seconds=self.seconds, drafts=drafts,
                   accepted=accepted, preemptions=preempted, outputs=self.outputs,
                   decode_tokens=self.decode_tokens, decode_seconds=self.decode_seconds)


def closed_loop(engine, prompt_ids: list[list[int]], concurrency: int, params, tag: str,
                after: list[int | None] | None = None) -> Run:
    """Keep `concurrency` requests in flight until every prompt has finished."""
    return interleaved([ClosedLoop(engine, prompt_ids, concurrency, params, tag, after)])[0]


def interleaved(loops: list[ClosedLoop]) -> list[Run]:
    """Run several engines' loops side by side, one step of each in turn: a machine whose
    speed drifts by tens of percent within a minute (shared cloud CPUs) slows them alike."""
    while not all(loop.done for loop in loops):
        for loop in loops:
            if not loop.done:
                loop.step()
    return [loop.result() for loop in loops]


def load_engines(args: argparse.Namespace, configs: list[tuple[str, dict]]) -> dict:
    """{method: LLM}, "none" first; one engine each, reused at every level."""
    from specserve import LLM

    common = {"max_num_seqs": max(args.concurrency), "max_model_len": args.max_model_len,
              "dtype": args.dtype, "enable_prefix_caching": args.prefix_caching,
              "quantization": args.quantization}
    engines = {"none": LLM(args.model, speculative_config=None, **common)}
    if args.control:
        engines["none-2"] = LLM(args.model, speculative_config=None, **common)
    for name, keys in configs:
        engines[name] = LLM(args.model, speculative_config=keys, **common)
    return engines


def encode(llm, rows: list[dict], max_tokens: int, max_model_len: int) -> list[list[int]]:
    """Chat-template token ids of each prompt; a prompt that leaves no room for max_tokens is
    an error (its output would be cut short)."""
    out = []
    for r in rows:
        ids = llm.apply_chat_template([{"role": "user", "content": r["prompt"]}])
        if len(ids) + max_tokens > max_model_len:
            raise ValueError(f"prompt {r['id']}: {len(ids)} tokens + --max-tokens {max_tokens} "
                             f"exceed --max-model-len {max_model_len}")
        out.append(ids)
    return out


def agentic_prompt_ids(llm, split: str, max_tokens: int,
                       max_model_len: int) -> tuple[list[list[list[int]]], dict]:
    """Per agentic conversation of `split`, every turn as a prompt (the conversation so far),
    the assistant turns plain decoding's greedy replies (llm: a plain engine); and the count of
    prompts per kind."""
    from specserve import SamplingParams
    from specserve.bench.spec import load_conversations

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    out, kinds = [], {}
    for conv in load_conversations(split):
        messages = [{"role": "system", "content": conv["system"]}] if conv.get("system") else []
        out.append([])
        for turn in conv["turns"]:
            messages.append({"role": "user", "content": turn})
            ids = llm.apply_chat_template(messages)
            if len(ids) + max_tokens > max_model_len:
                raise ValueError(f"conversation {conv['id']}: {len(ids)} tokens + --max-tokens "
                                 f"{max_tokens} exceed --max-model-len {max_model_len}")
            out[-1].append(ids)
            kinds[conv["kind"]] = kinds.get(conv["kind"], 0) + 1
            reply = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].text
            messages.append({"role": "assistant", "content": reply})
    return out, kinds


def warm_up(engines: dict, concurrency: int, params) -> None:
    """A short batch per engine (up to 16 in flight, a prompt outside the workload), so that
    no timed run pays first-call costs: first touches of the KV cache, batched code paths."""
    for name, llm in engines.items():
        ids = llm.apply_chat_template([{"role": "user", "content": "Say hello in three languages."}])
        n = min(concurrency, 16)
        closed_loop(llm.engine, [ids] * n, n, params, f"warmup-{name}")


def run_level(engines: dict, prompt_ids: list[list[int]], concurrency: int, level: int,
              repeats: int, params, sequential: bool = False,
              after: list[int | None] | None = None) -> dict[str, list[Run]]:
    """Every method over the same request list (`after`: see ClosedLoop), `repeats` rounds in
    this level's order: the methods' steps alternating (default), or one method's whole run
    after another."""
    runs: dict[str, list[Run]] = {m: [] for m in engines}
    order = rotated(list(engines), level)
    for rep in range(repeats):
        tags = [(engines[m].engine, f"{m}-c{concurrency}-r{rep}") for m in order]
        if sequential:
            results = [closed_loop(e, prompt_ids, concurrency, params, tag, after) for e, tag in tags]
        else:
            results = interleaved([ClosedLoop(e, prompt_ids, concurrency, params, tag, after)
                                   for e, tag in tags])
        for m, r in zip(order, results):
            runs[m].append(r)
            print(f"  c={concurrency:<3} {m:<12} run {rep + 1}/{repeats}: {r.tokens} tokens in "
                  f"{r.seconds:.2f} s, {r.tokens_per_s:.1f} tok/s", flush=True)
    return runs


def summarise_level(concurrency: int, runs: dict[str, list[Run]]) -> dict:
    """A table row: per method the median throughput, speedup over none, acceptance length
    and mismatches against none's first run (any repeat that differs counts)."""
    reference = runs["none"][0].outputs
    base = statistics.median(r.tokens_per_s for r in runs["none"])
    decode_base = statistics.median(r.decode_tokens_per_s for r in runs["none"])
    methods = {}
    for m, rs in runs.items():
        tps = statistics.median(r.tokens_per_s for r in rs)
        decode = statistics.median(r.decode_tokens_per_s for r in rs)
        drafts, accepted = sum(r.drafts for r in rs), sum(r.accepted for r in rs)
        mismatches = sum(any(r.outputs[i] != ref for r in rs) for i, ref in enumerate(reference))
        methods[m] = {"tokens_per_s": round(tps, 2),
                      "speedup": round(tps / base, 3) if base else None,
                      "decode_tokens_per_s": round(decode, 2),
                      "decode_speedup": round(decode / decode_base, 3) if decode_base else None,
                      "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
                      "mismatches": mismatches, "tokens": rs[0].tokens,
                      "seconds": [round(r.seconds, 3) for r in rs],
                      "drafts": drafts, "accepted": accepted,
                      "preemptions": sum(r.preemptions for r in rs)}
    return {"concurrency": concurrency, "requests": len(reference), "methods": methods}


def run(args: argparse.Namespace) -> dict:
    from specserve import SamplingParams

    configs = check_options(args)  # before any model loads
    rows = load_prompts(args.split)
    engines = load_engines(args, configs)
    first = engines["none"]
    if args.workload == "agentic":
        conversations, kinds = agentic_prompt_ids(first, args.split, args.max_tokens, args.max_model_len)
        prompt_ids = [ids for turns in conversations for ids in turns]
    else:
        prompt_ids = encode(first, rows, args.max_tokens, args.max_model_len)
        kinds = {k: sum(r["kind"] == k for r in rows) for k in ("chat", "code")}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    warm_up(engines, max(args.concurrency), params)
    table = []
    for level, c in enumerate(args.concurrency):
        if args.workload == "agentic":  # c conversations in flight, each turn after the one before
            ids, after = conversation_list(conversations, c, args.requests)
        else:
            ids, after = request_list(prompt_ids, c, args.requests), None
        print(f"concurrency {c}: {len(ids)} requests, order {', '.join(rotated(list(engines), level))}",
              flush=True)
        table.append(summarise_level(c, run_level(engines, ids, c, level, args.repeats, params,
                                                  args.sequential, after)))
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
              "dtype": str(first.engine.runner.dtype).removeprefix("torch."),
              "quantization": args.quantization,
              "split": args.split, "workload": args.workload, "num_prompts": len(prompt_ids),
              "prompts": kinds,
              "methods": {"none": None, **({"none-2": None} if args.control else {}), **dict(configs)},
              "options": {k: v for k, v in vars(args).items() if k != "func" and not k.startswith("_")},
              "rows": table}
    print_table(result)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "load.json").write_text(json.dumps(result, indent=2))
    plot(result, out_dir / "load.png")
    print(f"wrote {out_dir / 'load.json'} and {out_dir / 'load.png'}")
    return result


def print_table(result: dict) -> None:
    methods = list(result["methods"])
    cell = f"{'tok/s':>9}{'speedup':>9}{'decode':>9}{'acc.len':>9}{'mismatch':>10}"
    width = len(cell)
    caching = ", prefix caching on" if result.get("options", {}).get("prefix_caching") else ""
    print(f"split {result['split']} ({result['num_prompts']} prompts), dtype {result['dtype']}{caching}")
    print(f"{'':>6}" + "".join(f"{m:>{width}}" for m in methods))
    print(f"{'conc':>6}" + cell * len(methods))
    for row in result["rows"]:
        line = f"{row['concurrency']:>6}"
        for m in methods:
            s = row["methods"][m]
            decode = s.get("decode_speedup")
            line += (f"{s['tokens_per_s']:>9.1f}{s['speedup']:>9.2f}"
                     f"{'-' if decode is None else f'{decode:.2f}':>9}"
                     f"{s['mean_acceptance_length']:>9.2f}{s['mismatches']:>10}")
        print(line)
    print("tok/s: output tokens / seconds of the method's own engine steps (median of repeats); "
          "speedup over none at that level; decode: the same speedup over the steps without a "
          "prefill chunk only")
    preempted = sum(s["preemptions"] for row in result["rows"] for s in row["methods"].values())
    if preempted:
        print(f"note: {preempted} preemptions (KV cache full); see load.json")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [row["concurrency"] for row in result["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in result["methods"]:
        if m != "none":
            ax.plot(levels, [row["methods"][m]["speedup"] for row in result["rows"]], marker="o", label=m)
    ax.axhline(1.0, color="gray", lw=1, ls="--", label="plain decoding")
    ax.axhline(0.97, color="gray", lw=1, ls=":", label="3% slower")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("throughput speedup over plain decoding")
    workload = "agentic turns" if result.get("workload") == "agentic" else "chat + code"
    ax.set_title(f"{workload}, split {result['split']}, greedy ({result['date']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    run(add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv))


if __name__ == "__main__":
    main()
