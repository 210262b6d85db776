"""specserve bench spec: prompt selection and option checks (no model runs there); the step
breakdown benchmark on a tiny random model."""

import pytest

from specserve.bench.spec import CATEGORIES, MT_BENCH, load_prompts, named_configs


def test_prompts_per_category_and_mt_bench_split():
    five = load_prompts(CATEGORIES, 5)
    assert [c for c, _ in five] == [c for c in CATEGORIES for _ in range(5)]
    split = load_prompts(["mt_bench"], 1, mt_bench_split=True)
    assert sorted(c for c, _ in split) == sorted(f"mt_bench/{c}" for c in MT_BENCH)  # one per sub-category
    assert len({t for _, t in split}) == 8
    assert load_prompts(["mt_bench"], 1)[0] == (split[0][0].split("/")[0], split[0][1])
    later = load_prompts(CATEGORIES, 3, skip=2)  # each category's 3rd to 5th questions
    assert later == [p for i, p in enumerate(five) if i % 5 >= 2]


def test_eagle_variants_parse_or_fail_clearly():
    assert named_configs(['p0={"min_draft_prob": 0}', 'm12={"num_speculative_tokens": 12}']) == [
        ("p0", {"min_draft_prob": 0}), ("m12", {"num_speculative_tokens": 12})]
    for bad in ['p0', 'p0={"min_draft_prob": ', '={"a": 1}', 'x=[1]']:
        with pytest.raises(ValueError, match="--eagle-variant"):
            named_configs([bad])
    with pytest.raises(ValueError, match="--config 'x'"):  # the option that was wrong is named
        named_configs(["x"], "--config")


def test_options_no_engine_would_read_are_errors():
    import argparse

    from specserve.bench.spec import add_args, run

    parser = add_args(argparse.ArgumentParser())
    for argv, message in [(["--min-draft-prob", "0.1"], "--min-draft-prob needs --eagle"),
                          (["--lookup-branch", "2"], "--lookup-branch needs --eagle or --medusa"),
                          (["--mt-bench-split", "--category", "qa"], "--mt-bench-split needs the mt_bench"),
                          (["--skip", "-1"], "--skip: expected a count >= 0"),
                          (["--skip", "5", "--workload", "agentic"], "--skip applies to Spec-Bench"),
                          (["--eagle-variant", 'p0={"min_draft_prob": 0}'], "--eagle-variant .* need --eagle")]:
        with pytest.raises(ValueError, match=message):  # raised before any model loads
            run(parser.parse_args(argv))


def test_step_breakdown_times_every_decode_step(tmp_path):
    from benchmarks.step_breakdown import measure
    from tests.test_eagle_medusa import tiny_llm

    llm = tiny_llm(tmp_path, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # something to look up
    r = measure(llm, [prompt, prompt[:6]], max_tokens=12)
    assert 0 < r["forward_ms"] <= r["ms_per_step"] and r["propose_ms"] > 0 and r["verify_ms"] > 0
    assert r["rows_per_step"] >= 1 and r["tokens_per_step"] >= 1 and r["forward_ms_by_rows"]
    assert set(r["forward_ms_by_rows"]) <= set(range(1, 5))  # the root plus up to 3 drafts


def test_attention_ab_compares_two_checkouts():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = str(root / "benchmarks" / "experiments" / "attention_ab.py")
    run = subprocess.run([sys.executable, script, "--base", str(root), "--contexts", "70", "--runs", "1", "--check"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert {"decode", "chain4", "tree4", "tree8"} <= {line.split()[1] for line in run.stdout.splitlines()[2:]}
    bad = subprocess.run([sys.executable, script, "--base", "/nonexistent"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "no specserve/model/attention.py" in bad.stderr


def test_draft_int8_times_the_heads_products_and_proposals():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = str(root / "benchmarks" / "experiments" / "draft_int8.py")
    run = subprocess.run([sys.executable, script, "--context", "40", "--rows", "1", "8", "--runs", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert {"fc", "qkv_proj", "gate_up_proj", "lm_head"} <= {line.split()[0] for line in lines[2:8]}
    assert "proposal (m 8, depth 4, top-2)" in run.stdout and "int8" in lines[-1]


def test_the_baseline_does_not_speculate(tmp_path, monkeypatch):
    """The "none" engine is plain decoding (LLM's own default is speculation, which made the
    baseline speculate for a while), and every other engine speculates."""
    import argparse
    import functools

    import specserve
    from specserve.bench.spec import add_args, build_engines
    from tests.test_eagle_medusa import tiny_llm

    tiny_llm(tmp_path)  # writes the tiny model's directory (random weights: load_format dummy)
    monkeypatch.setattr(specserve, "LLM", functools.partial(specserve.LLM, load_format="dummy", seed=3))
    args = add_args(argparse.ArgumentParser()).parse_args(["--model", str(tmp_path / "tiny-model"),
                                                           "--max-model-len", "256"])
    engines = build_engines(args, [])
    assert list(engines) == ["none", "ngram"]
    assert engines["none"].engine.config.spec.method is None
    assert engines["ngram"].engine.config.spec.method == "ngram"


def test_the_agentic_workload_splits_and_runs_every_turn(tmp_path, tiny_model_dir):
    """Its conversations are half dev, half heldout, of every kind in both; one run on a tiny
    model goes through every turn of the held-out half with plain, ngram and suffix engines."""
    import argparse

    from specserve.bench.spec import add_args, load_conversations, run

    dev, heldout = load_conversations("dev"), load_conversations("heldout")
    assert len(dev) == len(heldout) and {c["kind"] for c in dev} == {c["kind"] for c in heldout}
    assert all(len(c["turns"]) >= 2 for c in dev + heldout)
    with pytest.raises(ValueError, match="--split"):
        load_conversations("test")

    args = add_args(argparse.ArgumentParser()).parse_args([
        "--model", str(tiny_model_dir), "--max-model-len", "1024", "--workload", "agentic",
        "--split", "heldout", "--suffix", "--max-tokens", "4", "--out", str(tmp_path / "out")])
    result = run(args)
    assert {r["method"] for r in result["rows"]} == {"none", "ngram", "suffix"}
    assert {r["category"] for r in result["rows"]} == {c["kind"] for c in heldout}
    turns = sum(len(c["turns"]) for c in heldout)
    assert sum(r["tokens"] for r in result["rows"] if r["method"] == "none") == 4 * turns
    assert all(r["mismatches"] == 0 for r in result["rows"])
    assert (tmp_path / "out" / "spec_bench.png").exists()
