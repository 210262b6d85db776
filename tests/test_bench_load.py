"""specserve bench load: the workload file's shape, option checks (raised before any model
loads), the closed loop's request list, and one real run on a tiny random model."""

import argparse
import json
from importlib import resources

import pytest

from specserve.bench.load import add_args, load_prompts, request_list, rotated, run


def parse(argv: list[str]) -> argparse.Namespace:
    return add_args(argparse.ArgumentParser()).parse_args(argv)


def test_prompts_are_chat_and_code_each_half_dev_half_heldout():
    rows = load_prompts("all")
    assert 40 <= len(rows) <= 56
    assert len({r["id"] for r in rows}) == len(rows)
    assert {r["kind"] for r in rows} == {"chat", "code"} and {r["split"] for r in rows} == {"dev", "heldout"}
    for kind in ("chat", "code"):
        of_kind = [r for r in rows if r["kind"] == kind]
        assert len(of_kind) == len(rows) // 2
        assert sum(r["split"] == "dev" for r in of_kind) == len(of_kind) // 2
    assert all(r["prompt"].strip() for r in rows)
    assert sum("```" in r["prompt"] for r in rows if r["kind"] == "code") >= 8  # code to edit or explain
    dev, heldout = load_prompts("dev"), load_prompts("heldout")
    assert len(dev) == len(heldout) == len(rows) // 2 and not {r["id"] for r in dev} & {r["id"] for r in heldout}


def test_prompts_are_not_spec_bench_prompts():
    text = resources.files("specserve").joinpath("data/spec_bench/question.jsonl").read_text()
    spec_bench = {" ".join(t.split()) for line in text.splitlines() for t in json.loads(line)["turns"]}
    for r in load_prompts("all"):
        prompt = " ".join(r["prompt"].split())
        assert prompt not in spec_bench and not any(prompt[:80] in t for t in spec_bench), r["id"]


@pytest.mark.parametrize("argv, message", [
    (["--config", "ngram"], "--config 'ngram': expected NAME=JSON"),
    (["--config", 'ngram={"method": '], "--config .*expected NAME=JSON"),
    (["--config", 'none={"method": "ngram"}'], "'none' and 'none-2' are plain decoding"),
    (["--config", 'none-2={"method": "ngram"}'], "'none' and 'none-2' are plain decoding"),
    (["--config", 'a={"method": "ngram"}', "--config", 'a={"method": "eagle"}'], "names must be unique"),
    (["--config", "a={}"], "--config a: no speculative method"),
    (["--concurrency", "0", "4"], "--concurrency: every level must be at least 1"),
    (["--concurrency", "4", "--requests", "2"], "--requests 2: below --concurrency 4"),
    (["--repeats", "0"], "--repeats: must be at least 1"),
    (["--max-tokens", "0"], "--max-tokens: must be at least 1"),
])
def test_bad_options_are_clear_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        run(parse(argv))


def test_cli_prints_bad_options_without_a_traceback(capsys):
    from specserve.cli import main

    assert main(["bench", "load", "--concurrency", "0"]) == 2
    err = capsys.readouterr().err
    assert "specserve: error: --concurrency" in err and "Traceback" not in err


def test_request_list_cycles_and_order_rotates():
    assert request_list(list("abc"), 1, None) == list("abcabcab")  # max(2c, 8)
    assert request_list(list("abc"), 8, None) == list("abc" * 6)[:16]
    assert request_list(list("abc"), 2, 4) == list("abca")
    assert [rotated(["none", "ngram", "eagle"], k) for k in range(4)] == [
        ["none", "ngram", "eagle"], ["ngram", "eagle", "none"], ["eagle", "none", "ngram"],
        ["none", "ngram", "eagle"]]


def test_tiny_model_run_writes_json_and_png_and_is_lossless(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "out"
    result = run(parse(["--model", str(tiny_model_dir), "--concurrency", "1", "2", "--requests", "3",
                        "--max-tokens", "8", "--max-model-len", "512", "--split", "dev",
                        "--config", 'ngram={"method": "ngram"}', "--control", "--out", str(out)]))
    saved = json.loads((out / "load.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert (out / "load.png").stat().st_size > 0
    assert saved["split"] == "dev" and saved["dtype"] and saved["machine"]["cpu_count"]
    assert list(saved["methods"]) == ["none", "none-2", "ngram"] and saved["methods"]["none-2"] is None
    assert [row["concurrency"] for row in saved["rows"]] == [1, 2]
    for row in saved["rows"]:
        assert row["requests"] == 3 and set(row["methods"]) == {"none", "none-2", "ngram"}
        for stats in row["methods"].values():
            assert stats["mismatches"] == 0 and stats["tokens_per_s"] > 0 and stats["tokens"] > 0
            assert stats["decode_tokens_per_s"] > stats["tokens_per_s"]  # prefill steps left out
        assert row["methods"]["none"]["speedup"] == row["methods"]["none"]["decode_speedup"] == 1.0
        assert row["methods"]["ngram"]["tokens"] == row["methods"]["none"]["tokens"]
        assert row["methods"]["none-2"]["mean_acceptance_length"] == 1.0  # the control never drafts
    table = capsys.readouterr().out
    assert "tok/s" in table and "mismatch" in table and "split dev" in table and "decode" in table


def test_interleaved_loops_time_only_their_own_steps(tiny_model_dir):
    """Two engines stepping in turn: each gets the outputs it gets alone, and each run's
    seconds are its own steps only (together no more than the wall clock)."""
    import time

    from specserve import LLM, SamplingParams
    from specserve.bench.load import ClosedLoop, closed_loop, interleaved

    common = {"max_model_len": 256, "enable_prefix_caching": False}
    plain = LLM(str(tiny_model_dir), speculative_config=None, **common).engine
    ngram = LLM(str(tiny_model_dir), speculative_config={"method": "ngram"}, **common).engine
    prompts = [[1, 5, 9, 5, 9, 5, 9], [2, 7, 7, 7], [3, 4, 5, 6, 3, 4, 5], [8] * 5, [6, 2, 6, 2]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = closed_loop(plain, prompts, 2, params, "alone")
    start = time.perf_counter()
    runs = interleaved([ClosedLoop(plain, prompts, 2, params, "a"), ClosedLoop(ngram, prompts, 2, params, "b")])
    wall = time.perf_counter() - start
    assert [r.outputs for r in runs] == [alone.outputs, alone.outputs]
    assert all(len(o) == 12 for o in alone.outputs) and runs[0].tokens == 5 * 12
    assert 0 < runs[0].seconds and 0 < runs[1].seconds and runs[0].seconds + runs[1].seconds <= wall
    assert not plain.has_unfinished_requests() and not ngram.has_unfinished_requests()


def test_the_agentic_workload_runs_every_turn_losslessly(tmp_path, tiny_model_dir):
    from specserve.bench.spec import load_conversations

    result = run(parse(["--model", str(tiny_model_dir), "--concurrency", "2", "--max-tokens", "4",
                        "--max-model-len", "1024", "--split", "heldout", "--workload", "agentic",
                        "--config", 'suffix={"method": "suffix"}', "--out", str(tmp_path / "out")]))
    conversations = load_conversations("heldout")
    assert result["workload"] == "agentic"
    assert result["num_prompts"] == sum(len(c["turns"]) for c in conversations)
    assert set(result["prompts"]) == {c["kind"] for c in conversations}
    row = result["rows"][0]
    assert row["methods"]["suffix"]["mismatches"] == 0
    assert row["methods"]["suffix"]["tokens"] == row["methods"]["none"]["tokens"]


def test_a_repeated_prompt_never_drafts_from_its_earlier_answer(tiny_model_dir):
    """Each pass over the prompt list is a tenant of its own: suffix decoding's corpus for a
    prompt's second appearance holds the other prompts' outputs, not its own first answer."""
    from specserve import LLM, SamplingParams
    from specserve.bench.load import ClosedLoop, interleaved

    suffix = LLM(str(tiny_model_dir), speculative_config={"method": "suffix"}, max_model_len=256,
                 enable_prefix_caching=False).engine
    prompts = [[1, 5, 9, 5, 9], [2, 7, 7, 7], [1, 5, 9, 5, 9], [3, 4, 5], [2, 7, 7, 7]]
    loop = ClosedLoop(suffix, prompts, 1, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), "t")
    assert loop.passes == [0, 0, 1, 0, 1]
    run = interleaved([loop])[0]
    corpora = suffix.spec.proposer._corpora
    assert set(corpora) == {"t-pass0", "t-pass1"}
    assert len(corpora["t-pass0"].docs) == 3 and len(corpora["t-pass1"].docs) == 2
    assert run.decode_tokens <= run.tokens and run.decode_seconds <= run.seconds


def test_with_prefix_caching_each_run_starts_cold(tmp_path, tiny_model_dir):
    """--prefix-caching: a request reuses what its run computed before it, never what an
    earlier run (or the warm-up) left in the cache."""
    from specserve import LLM, SamplingParams
    from specserve.bench.load import closed_loop

    plain = LLM(str(tiny_model_dir), speculative_config=None, max_model_len=256).engine
    shared = list(range(3, 40))  # two full blocks of 16 every prompt starts with
    prompts = [shared + [41, 42], shared + [43], shared + [44, 45, 46]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    hits = []
    for tag in ("first", "second"):
        before = plain.stats.prefix_cache_hit_tokens
        closed_loop(plain, prompts, 1, params, tag)
        hits.append(plain.stats.prefix_cache_hit_tokens - before)
    assert hits == [2 * 32, 2 * 32]  # the later prompts of each run hit the first one's blocks

    result = run(parse(["--model", str(tiny_model_dir), "--concurrency", "2", "--max-tokens", "4",
                        "--max-model-len", "1024", "--split", "heldout", "--workload", "agentic",
                        "--prefix-caching", "--config", 'suffix={"method": "suffix"}',
                        "--out", str(tmp_path / "out")]))
    assert result["options"]["prefix_caching"]
    row = result["rows"][0]
    assert row["methods"]["suffix"]["mismatches"] == 0
    assert row["methods"]["suffix"]["tokens"] == row["methods"]["none"]["tokens"]


def test_agentic_turns_are_sent_in_order_with_c_conversations_in_flight(tiny_model_dir):
    """An agent sends a turn once its conversation's previous turn has finished: the request
    list cycles through whole conversations, and no turn is sent before the one it follows
    has finished, while `concurrency` conversations stay in flight."""
    from specserve import LLM, SamplingParams
    from specserve.bench.load import ClosedLoop, conversation_list, interleaved

    convs = [[[1, 2], [1, 2, 3], [1, 2, 3, 4]], [[5, 6], [5, 6, 7]]]
    ids, after = conversation_list(convs, 1, None)  # max(2c, all) conversations: both
    assert ids == convs[0] + convs[1] and after == [None, 0, 1, None, 3]
    ids, after = conversation_list(convs, 2, None)  # 2c = 4 of them, cycling
    assert ids == (convs[0] + convs[1]) * 2 and after == [None, 0, 1, None, 3] + [None, 5, 6, None, 8]
    ids, after = conversation_list(convs, 2, 6)  # 6 turns: cut in the second pass
    assert len(ids) == 6 and after == [None, 0, 1, None, 3, None]

    engine = LLM(str(tiny_model_dir), speculative_config=None, max_model_len=256).engine
    ids, after = conversation_list(convs, 2, None)  # 4 conversations, 10 turns
    loop = ClosedLoop(engine, ids, 2, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), "t", after)
    sent, in_flight = {}, []
    step = loop.step

    def watched():
        step()
        in_flight.append(engine.scheduler.num_running + engine.scheduler.num_waiting)
        for rid, i in loop.index.items():
            sent.setdefault(i, len(in_flight))  # the step after which request i was in the engine

    loop.step = watched
    sent.update({i: 0 for i in loop.index.values()})
    assert sorted(sent) == [0, 3]  # the two conversations' first turns
    run = interleaved([loop])[0]
    assert all(o is not None and len(o) == 3 for o in run.outputs)
    for i, j in enumerate(after):
        if j is not None:  # sent only after the turn before it finished (it ran at least 3 steps)
            assert sent[i] >= sent[j] + 3, (i, j, sent)
    assert max(in_flight) == 2 and in_flight[:-1].count(2) >= len(in_flight) - 4
