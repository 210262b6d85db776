"""The speculative machinery's own time per request and step, apart from the models' compute.

A tiny random target (hidden 64, 2 layers, a vocabulary of --vocab tokens, 512 by default)
makes the target forward cheap, so what is left of an engine step is the engine's own work,
mostly Python: scheduling, drafting (with random EAGLE/Medusa heads, a draft model that is the
target itself, or prompt lookup), verification, KV rollback and bookkeeping. With --vocab 49152
(the default model's) the vocabulary-sized work (LM heads, top-k, argmax, noise) counts too.
Every method drafts its maximum each step (`"adaptive": false`), on B requests at once, greedy.

    python benchmarks/spec_overhead.py [--batch 1 16 64] [--methods none ngram eagle medusa draft_model]
        [--vocab 512] [--max-tokens 48] [--repeats 1] [--clock wall] [--dtype float32] [--lookup-branch N]
        [--json OUT.json]

Reports, per method and batch size, milliseconds per decode step outside the target forward,
divided by B (the per-request overhead); the part of it that is not the draft network's own
forward (its forward and its LM head products, timed by wrappers: what is left is the
machinery, mostly Python); and the target forward's own milliseconds per step.
Runs against whichever specserve is importable (PYTHONPATH=../other-checkout to compare).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
CLOCK = time.perf_counter  # --clock thread: this thread's CPU time (a busy machine's steal left out)

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def write_fixtures(root: Path, vocab: int = 512) -> tuple[Path, Path, Path]:
    """A tiny model directory (the default model's tokenizer), a random EAGLE-1 head and
    random Medusa heads for it."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from specserve.config import DEFAULT_MODEL
    from specserve.model.loader import resolve_model_dir

    model = root / "tiny"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({**TINY, "vocab_size": vocab}))
    for f in resolve_model_dir(DEFAULT_MODEL).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy(f, model / f.name)
    g = torch.Generator().manual_seed(0)
    h, i, v = TINY["hidden_size"], TINY["intermediate_size"], vocab
    kv = TINY["num_key_value_heads"] * TINY["head_dim"]
    eagle = root / "eagle"
    eagle.mkdir(exist_ok=True)
    state = {"fc.weight": (2 * h, h), "fc.bias": (h,), "layers.0.self_attn.q_proj.weight": (h, h),
             "layers.0.self_attn.k_proj.weight": (h, kv), "layers.0.self_attn.v_proj.weight": (h, kv),
             "layers.0.self_attn.o_proj.weight": (h, h), "layers.0.mlp.gate_proj.weight": (h, i),
             "layers.0.mlp.up_proj.weight": (h, i), "layers.0.mlp.down_proj.weight": (i, h),
             "layers.0.post_attention_layernorm.weight": (h,)}
    save_file({k: torch.randn(tuple(reversed(s)), generator=g) * 0.2 for k, s in state.items()},
              str(eagle / "model.safetensors"))
    (eagle / "config.json").write_text(json.dumps({**TINY, "vocab_size": vocab, "num_hidden_layers": 1}))
    medusa = root / "medusa"
    medusa.mkdir(exist_ok=True)
    heads = {}
    for k in range(4):
        heads[f"{k}.0.linear.weight"] = torch.randn(h, h, generator=g) * 0.1
        heads[f"{k}.0.linear.bias"] = torch.zeros(h)
        heads[f"{k}.1.weight"] = torch.randn(v, h, generator=g) * 0.2
    save_file(heads, str(medusa / "medusa_lm_head.safetensors"))
    (medusa / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1}))
    return model, eagle, medusa


def spec_config(method: str, eagle: Path, medusa: Path, model: Path, lookup_branch: int | None = None) -> dict | None:
    fixed = {"adaptive": False}
    tree = {} if lookup_branch is None else {"lookup_branch": lookup_branch}  # tree methods' grafted lookup
    return {"none": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": 4, **fixed},
            "eagle": {"method": "eagle", "model": str(eagle), "num_speculative_tokens": 8,
                      "min_draft_prob": 0, "quantization": "none", **fixed, **tree},
            "medusa": {"method": "medusa", "model": str(medusa), "num_speculative_tokens": 16,
                       "quantization": "none", **fixed, **tree},
            "draft_model": {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3,
                            **fixed}}[method]


def measure(llm, batch: int, max_tokens: int, seed: int = 0, vocab: int = 512, repeats: int = 1) -> dict:
    """Decode-only steps of `batch` requests run together: ms per step outside the target forward
    (per request) and inside it. After a warm-up round, `repeats` rounds; the round with the
    least overhead counts (the machine's own noise only ever adds time)."""
    from specserve import SamplingParams

    engine = llm.engine
    execute = engine.runner.execute
    last = {"decode_only": False, "seconds": 0.0}

    def timed_execute(sched, *args, **kwargs):
        start = CLOCK()
        out = execute(sched, *args, **kwargs)
        last["seconds"] = CLOCK() - start
        last["decode_only"] = sched.decode_only
        return out

    engine.runner.execute = timed_execute
    draft_s = [0.0]
    undo = _time_draft_network(engine, draft_s)
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rounds = []
    for rep in range(1 + repeats):  # the first round warms up
        totals = {"steps": 0, "step_s": 0.0, "forward_s": 0.0, "draft_s": 0.0}
        for b in range(batch):
            pattern = [rng.randrange(3, vocab) for _ in range(8)]
            engine.add_request(f"r{rep}-{b}", (pattern * 8)[:60], params)
        while engine.has_unfinished_requests():
            draft_s[0] = 0.0
            start = CLOCK()
            engine.step()
            seconds = CLOCK() - start
            if rep and last["decode_only"] and len(engine.scheduler.running) == batch:
                totals["steps"] += 1
                totals["step_s"] += seconds
                totals["forward_s"] += last["seconds"]
                totals["draft_s"] += draft_s[0]
            last["decode_only"] = False
        if rep:
            steps = max(1, totals["steps"])
            overhead = totals["step_s"] - totals["forward_s"]
            rounds.append({"steps": totals["steps"],
                           "overhead_ms_per_request": 1e3 * overhead / steps / batch,
                           "machinery_ms_per_request": 1e3 * (overhead - totals["draft_s"]) / steps / batch,
                           "forward_ms": 1e3 * totals["forward_s"] / steps})
    engine.runner.execute = execute
    for u in undo:
        u()
    return min(rounds, key=lambda r: r["overhead_ms_per_request"])


def _time_draft_network(engine, total: list[float]) -> list:
    """Adds to total[0] the seconds of the proposer's network: the forward of an EAGLE head (its
    `draft` pass), Medusa heads or a draft model and their LM head products (the proposer's
    `_lm_head` / `lm_head`, Medusa's `heads.logits`, the draft model's `compute_logits`),
    nested calls counted once. Each is wrapped as an instance attribute, not a forward hook: hooks send
    every module call down torch's slow path, whose extra time would count as machinery.
    Works on any checkout whose engine keeps its proposer at engine.spec.proposer. Returns
    the callables that undo it."""
    from torch import nn

    proposer = getattr(engine.spec, "proposer", None)
    heads = getattr(proposer, "heads", None)
    model = getattr(getattr(proposer, "runner", None), "model", None)
    targets = [(m, "forward") for m in (getattr(proposer, "head", None), heads, model) if m is not None]
    if heads is not None and type(heads).forward is nn.ModuleList.forward:
        targets = [(m, "forward") for head in heads for m in head]  # older Medusa: blocks called one by one
    targets += [(proposer, "draft"), (proposer, "_lm_head"), (proposer, "lm_head"), (heads, "logits"),
                (model, "compute_logits")]
    depth, started = [0], [0.0]
    undo = []
    for owner, name in targets:
        fn = getattr(owner, name, None) if owner is not None else None
        if not callable(fn):
            continue

        def timed(*args, _fn=fn, **kwargs):
            if depth[0] == 0:
                started[0] = CLOCK()
            depth[0] += 1
            try:
                return _fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    total[0] += CLOCK() - started[0]

        own = vars(owner)  # the wrapper shadows the method (or callable) as an instance attribute
        undo.append(lambda own=own, name=name, had=name in own, was=own.get(name):
                    own.__setitem__(name, was) if had else own.pop(name, None))
        own[name] = timed
    return undo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--methods", nargs="+", default=["none", "ngram", "eagle", "medusa", "draft_model"])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--vocab", type=int, default=512, help="the tiny target's vocabulary")
    p.add_argument("--repeats", type=int, default=1, help="measured rounds per batch size (the quietest counts)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--dtype", default="float32", help="every engine's dtype (float32: as on every CPU "
                   "where our kernels run; compare checkouts in one dtype)")
    p.add_argument("--lookup-branch", type=int, default=None,
                   help="EAGLE's and Medusa's grafted prompt-lookup chain (speculative_config's "
                        "lookup_branch; 0: off, the default up to 898a9af (the rework came with 4); default: "
                        "the checkout's own default)")
    p.add_argument("--clock", choices=["wall", "thread"], default="wall",
                   help="thread: the engine thread's CPU seconds instead of wall seconds")
    args = p.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter
    import torch

    from specserve import LLM

    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model, eagle, medusa = write_fixtures(Path(tmp), args.vocab)
        for method in args.methods:
            llm = LLM(str(model), load_format="dummy", seed=3, max_model_len=512, num_blocks=2048, dtype=args.dtype,
                      max_num_seqs=max(args.batch), max_num_batched_tokens=8192,
                      speculative_config=spec_config(method, eagle, medusa, model, args.lookup_branch))
            for b in args.batch:
                r = measure(llm, b, args.max_tokens, vocab=args.vocab, repeats=args.repeats)
                rows.append({"method": method, "batch": b, "vocab": args.vocab, **r})
                print(f"{method:<12} B={b:<3} overhead {r['overhead_ms_per_request']:7.2f} ms/request/step "
                      f"(machinery {r['machinery_ms_per_request']:5.2f})   "
                      f"forward {r['forward_ms']:7.1f} ms/step   ({r['steps']} steps)", flush=True)
            del llm
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
