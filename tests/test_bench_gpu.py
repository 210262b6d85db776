"""`specserve bench gpu`: its CPU dry run end to end (every part recorded, with tiny shapes), and
the guards that keep one failing or hanging part from taking the others with it."""

from __future__ import annotations

import argparse
import json
import sys
import time

import pytest

from specserve.bench import gpu


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, tiny_model_dir):
    from specserve.cli import main

    out = tmp_path_factory.mktemp("bench_gpu")
    start = time.time()
    rc = main(["bench", "gpu", "--device", "cpu", "--out", str(out), "--real-model", str(tiny_model_dir),
               "--real-dtypes", "bfloat16"])
    return rc, out, json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text(), time.time() - start


def test_dry_run_records_every_part(dry_run):
    rc, out, report, md, seconds = dry_run
    assert rc == 0
    parts = report["parts"]
    assert list(parts) == list(gpu.PARTS)
    assert report["meta"]["quick"] and report["meta"]["device"] == "cpu"
    assert "--device cpu" in report["meta"]["command"]
    assert seconds < report["meta"]["budget_s"]

    # 1. kernel tests: pytest ran and its summary was read
    kt = parts["kernel_tests"]
    assert kt["status"] == "ok", kt
    assert kt["returncode"] == 0 and kt["counts"]["passed"] > 0 and "passed" in kt["summary"]

    # 2. kernel sweep: ours and a baseline for each kind; the rows printed parse as the JSON's
    ks = parts["kernel_sweep"]
    assert ks["status"] == "ok", ks
    assert {(r["kind"], r["impl"]) for r in ks["rows"]} >= {("decode", "triton"), ("tree", "triton"),
                                                             ("decode", "sdpa_flash"), ("tree", "sdpa_mask"),
                                                             ("prefill", "triton"), ("prefill", "sdpa_flash")}
    assert all(r["ms"] > 0 for r in ks["rows"])
    assert {c["kind"] for c in ks["summary"]} == {"decode", "tree", "prefill"}
    printed = [m.groups() for ln in (out / "kernel_sweep.log").read_text().splitlines()
               if (m := gpu._ROW.match(ln.strip()))]
    assert len(printed) == len(ks["rows"])
    assert (out / "kernels" / "kernels.json").is_file()

    # 3. decode: eager at each level; graphs and the roofline skipped with their reasons
    dec = parts["decode"]
    assert dec["status"] == "ok", dec
    for c in (1, 4):
        cell = dec[f"eager.c{c}"]
        assert cell["tok_s"] > 0 and cell["failed_steps"] == 0
        assert cell["tokens"] == c * (dec["settings"]["new_tokens"] - 1)  # the decode steps' tokens
    assert dec["eager.setup"]["step_mode"] == {"compiled": False, "graphs": False}
    assert "CUDA" in dec["skipped"]["graphs"] and "--peak-gbps" in dec["skipped"]["roofline"]

    # 4. step profile: wall time; GPU time and launches skipped on a CPU, graphs too
    prof = parts["step_profile"]
    assert prof["status"] == "ok", prof
    assert prof["eager"]["wall_ms"] > 0 and prof["eager"]["top_host_ops_ms_per_step"]
    assert set(prof["eager"]["skipped"]) == {"gpu_busy_ms", "launches_per_step"}
    assert "CUDA" in prof["skipped"]["graphs"]

    # 5. greedy equality: every dtype x method, mismatch counts against plain decoding
    gr = parts["greedy"]
    assert gr["status"] == "ok", gr
    batches = gr["settings"]["batches"]
    for dtype in ("bfloat16", "float32"):
        assert gr[f"{dtype}.plain"]["bs1_tok_s"] > 0
        for method in ("ngram", "eagle"):
            row = gr[f"{dtype}.{method}"]
            assert "error" not in row, row
            assert all(0 <= row[f"mismatch_bs{b}"] <= b for b in batches)
            assert row["tokens_per_verify"] >= 1
    assert all(gr["float32.ngram"][f"mismatch_bs{b}"] == 0 for b in batches)  # lossless on the CPU

    # 6. the real-model part, here on a tiny saved model: plain and ngram measured, eagle (no head
    # for this model) recorded as that method's error while the others stand
    real = parts["real_model"]
    assert real["status"] == "partial", real
    conc = real["settings"]["concurrency"]
    assert all(real["bfloat16.plain"][f"c{c}"]["tok_s"] > 0 for c in conc)
    assert all(real["bfloat16.ngram"][f"c{c}"]["mismatch"] == 0 for c in conc)
    assert "head" in real["bfloat16.eagle"]["error"]
    cells = [real[f"bfloat16.{m}"][f"c{c}"] for m in ("plain", "ngram") for c in conc]
    assert all(len(cell["runs_tok_s"]) == 2 and cell["tok_s"] == max(cell["runs_tok_s"]) for cell in cells)
    # the speculative decoder's choices over the timed runs: none for plain decoding
    kinds = ("spec_steps_drafting", "spec_steps_lookup_only", "spec_steps_plain")
    assert all(real["bfloat16.plain"][f"c{c}"][k] == 0 for c in conc for k in kinds)
    assert all(sum(real["bfloat16.ngram"][f"c{c}"][k] for k in kinds) > 0 for c in conc)
    # under load, the engine's phases: each a share of the wall time, the rest too
    top = max(conc)
    for method in ("plain", "ngram"):
        ph = real[f"bfloat16.{method}"][f"phases_c{top}"]
        assert ph["steps"] >= ph["decode_steps"] > 0 and ph["forward"] > 0 and ph["tok_s"] > 0
        assert ph["rest_ms"] >= 0 and ph["forward"] + ph.get("propose", 0) + ph.get("verify", 0) \
            <= ph["wall_ms_per_step"] + 1e-3
    assert real["bfloat16.ngram"][f"phases_c{top}"]["propose"] >= 0

    # the markdown: a status row per part and a section per measured part
    for p in gpu.PARTS:
        assert f"| {p} | {parts[p]['status']} |" in md
    for title in ("## Kernel tests", "## Attention kernels", "## Decode", "## One decode step",
                  "## Greedy equality", "## Real model"):
        assert title in md
    assert "| eager | 4 |" in md and "| float32 | ngram |" in md
    assert f"- bfloat16.ngram, {top} in flight, each phase synchronised:" in md


def test_quick_run_skips_the_real_model_with_its_reason(tmp_path):
    from specserve.cli import main

    assert main(["bench", "gpu", "--device", "cpu", "--out", str(tmp_path), "--parts", "real_model"]) == 0
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["parts"]["real_model"]["status"] == "skipped"
    assert "--quick" in report["parts"]["real_model"]["note"]
    assert report["parts"]["decode"] == {"status": "skipped", "note": "not selected (--parts)"}
    assert "| real_model | skipped |" in (tmp_path / "gpu.md").read_text()


def test_failing_and_hanging_parts_are_recorded(tmp_path):
    s = gpu.settings(gpu.add_args(argparse.ArgumentParser()).parse_args(
        ["--device", "cpu", "--kernel-tests", "tests/kernels/no_such_test_file.py"]), "cpu")
    rec = gpu._kernel_tests(s, tmp_path, timeout=120)
    assert rec["status"] == "failed" and rec["returncode"] not in (0, None)
    assert (tmp_path / "kernel_tests.log").read_text()

    start = time.time()
    rc, tail, _ = gpu._streamed([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(120)"],
                                2.0, tmp_path / "hang.log", "hang")
    assert rc is None and "started" in tail and time.time() - start < 30

    # a model part stopped at its limit: "timeout", the time it ran, and no crash of the report
    records = gpu._child_group(("greedy",), ["greedy"], s, tmp_path, 1.0)
    assert records["greedy"]["status"] == "timeout" and records["greedy"]["seconds"] < 30
    report = {"meta": {"device_name": "cpu", "date": "today", "device": "cpu", "torch": "x", "quick": True,
                       "peak_gbps": None, "command": "specserve bench gpu"},
              "parts": {"kernel_tests": rec, "greedy": records["greedy"]}}
    md = gpu.markdown(report)
    assert "| kernel_tests | failed |" in md and "| greedy | timeout |" in md and "| decode | not run |" in md


def test_phases_time_the_proposers_own_calls(make_llm, tiny_model_dir):
    """At the most in flight the real-model part cuts the steps into phases, and, for a method
    with a per-request proposer (suffix decoding here), counts and times the proposer's calls;
    the proposer is left as it was."""
    from specserve import SamplingParams

    llm = make_llm(str(tiny_model_dir), speculative_config={"method": "suffix", "adaptive": False})
    proposer = llm.engine.spec.proposer
    prompts = ["one two three one two three one two three", "a b c a b c a b c a b"]
    ph = gpu._phases(llm, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), lambda: None)
    assert ph["draft_calls"] > 0 and ph["draft_ms_per_call"] > 0 and 1 <= ph["draft_requests_per_call"] <= 2
    assert ph["draft_calls"] <= ph["steps"] and ph["tokens"] == 48
    assert getattr(proposer.propose, "__func__", None) is type(proposer).propose  # unwrapped
    md = "\n".join(gpu._md_real({"real_model": {"settings": {"concurrency": [2]},
                                                 "float32.suffix": {"phases_c2": ph}}}))
    assert f"the proposer drafted in {ph['draft_calls']} steps" in md
