"""Tensor parallelism on the CPU (gloo): TP=2 and TP=3 give TP=1's greedy tokens, speculation
under TP gives plain decoding's tokens at the same TP size (ngram, EAGLE, draft model, trees
whose accepted paths move KV on every rank), and a killed worker fails requests without a hang.

The models are tiny (6 heads of 16, 2 layers, a vocabulary of 98 that splits unevenly across
3 ranks): 6 heads over 2 KV heads at TP=2, over 3 KV heads at TP=3 (tied embeddings), and over
1 KV head at TP=3 (the KV head replicated on every rank). One TP engine per model serves every
method: the speculative decoder is rebuilt on the same runner (`use`), so the workers start
once. Every rank takes our packed float32 kernel (as every CPU float32 target does), so the
shards run through the same C kernels as an unsplit model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from specserve import SamplingParams
from specserve.config import SpecConfig
from specserve.model.parallel import WorkerLost, check_shape, vocab_slice
from tests.test_eagle_medusa import Oracle

VOCAB = 98
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": p} for p in (
    [5, 9, 17, 33, 2, 8, 8, 1, 4], [7, 7, 1, 80], [11, 12, 13, 14, 11, 12, 13, 14, 11, 12],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60],
    [3], [90, 91, 92, 90, 91, 92, 90], [25, 50, 75, 25, 50], [60, 1, 61, 2, 62, 3, 63, 4],
    [88, 87, 86, 85, 84, 83, 82, 81], [30, 31, 30, 31, 30, 31])]
# name: (TP size, KV heads, tied embeddings)
CASES = {"tp2": (2, 2, False), "tp3": (3, 3, True), "tp3-kv-replicated": (3, 1, False)}


def write_model(path: Path, kv_heads: int, tied: bool) -> Path:
    from specserve.model.loader import resolve_model_dir

    path.mkdir(parents=True)
    for f in resolve_model_dir("smollm2-135m-instruct").iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, path / f.name)
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 96, "intermediate_size": 192,
        "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": tied, "eos_token_id": 97}))
    return path


def write_eagle_head(path: Path, aux_layers=()) -> Path:
    """A random EAGLE-1 head for the tiny models, without its own embedding: it reads the
    target's whole embedding and LM head, which rank 0 keeps under TP (with aux_layers: an
    EAGLE-3 head, reading those layers' outputs too)."""
    import torch

    from specserve.model.arch import ModelArch
    from specserve.spec_decode.eagle_head import EagleHead

    cfg = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 96, "intermediate_size": 192,
           "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 2,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512}
    g = torch.Generator().manual_seed(5)
    head = EagleHead(ModelArch.from_dict(cfg), aux_layers=aux_layers, out_norm=bool(aux_layers))
    path.mkdir(parents=True)
    torch.save({k: torch.randn(v.shape, generator=g) * 0.3 for k, v in head.state_dict().items()},
               path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"],
                                                  "eagle_aux_layers": list(aux_layers)}))
    return path


def build(make, model_dir: Path, tp: int, speculative_config=None):
    return make(str(model_dir), load_format="dummy", seed=3, max_model_len=256, num_blocks=256,
                block_size=4, tensor_parallel_size=tp, speculative_config=speculative_config)


def token_ids(llm, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def use(llm, config) -> None:
    """Rebuild the engine's speculative decoder for `config` on the same runner (and workers)."""
    from specserve.spec_decode import methods

    e = llm.engine
    e.runner.model.aux_layers = methods.aux_layers(SpecConfig.parse(config))  # (no compiled step under TP)
    e.spec = methods.make_decoder(SpecConfig.parse(config), e.runner, e.kv, e._stats, e.config.model,
                                  e.max_model_len, e.config.scheduler)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tp")
    write_eagle_head(root / "eagle")
    write_eagle_head(root / "eagle3", (0, 1))
    return root


@pytest.fixture(scope="module", params=list(CASES))
def case(request, root, make_llm):
    """(name, model dir, TP=1 greedy tokens, the TP engine, its plain greedy tokens)."""
    tp, kv_heads, tied = CASES[request.param]
    model_dir = write_model(root / request.param, kv_heads, tied)
    reference = token_ids(build(make_llm, model_dir, 1))
    eagle = {"method": "eagle", "model": str(root / "eagle"), "num_speculative_tokens": 6, "depth": 3,
             "topk": 2, "adaptive": False, "lookup_branch": 0}
    llm = build(make_llm, model_dir, tp, eagle)  # built with a head: rank 0 keeps the whole vocabulary
    use(llm, None)
    plain = token_ids(llm)
    yield request.param, model_dir, reference, llm, plain
    llm.engine.shutdown()


def test_tp_gives_tp1s_greedy_tokens(case):
    name, _, reference, llm, plain = case
    tp, kv_heads, _ = CASES[name]
    runner = llm.engine.runner
    attn = runner.model.layers[0].self_attn
    assert (runner.tp.size, attn.num_heads, attn.num_kv_heads) == (tp, 6 // tp, max(1, kv_heads // tp))
    assert runner.k_cache.shape[3] == max(1, kv_heads // tp)  # the KV cache holds this rank's KV heads
    assert runner.model.lm_head.weight.shape[0] == vocab_slice(VOCAB, tp, 0)[2]
    assert len(runner.tp.workers.procs) == tp - 1
    assert all(len(t) == GREEDY.max_tokens for t in plain)
    assert plain == reference  # all 10 prompts, all 32 tokens (docs/architecture.md)


@pytest.mark.parametrize("method", ["ngram", "eagle", "eagle3", "draft_model", "oracle_tree"])
def test_speculation_under_tp_is_lossless(case, root, method):
    name, model_dir, _, llm, plain = case
    stats = llm.engine.stats
    moves = []
    if method == "oracle_tree":  # accepted paths hidden behind decoys: their KV moves on every rank
        use(llm, {"method": "ngram", "adaptive": False})
        spec = llm.engine.spec
        spec.proposer, spec.lookup, spec.max_drafts = Oracle({tuple(p["prompt_token_ids"]): o
                                                              for p, o in zip(PROMPTS, plain)}), None, 5
        runner = llm.engine.runner
        real = runner.move_kv
        runner.move_kv = lambda src, dst: (moves.append(len(src)), real(src, dst))
    else:
        config = {"ngram": {"method": "ngram", "num_speculative_tokens": 4},
                  "eagle": {"method": "eagle", "model": str(root / "eagle"), "num_speculative_tokens": 6,
                            "depth": 3, "topk": 2, "lookup_branch": 0},
                  "eagle3": {"method": "eagle", "model": str(root / "eagle3"), "num_speculative_tokens": 6,
                             "depth": 3, "topk": 2, "lookup_branch": 0},
                  # the target drafting for itself: rank 0's unsplit copy, against the split target
                  "draft_model": {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3},
                  }[method]
        use(llm, {**config, "adaptive": False})
    drafted, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
    try:
        got = token_ids(llm)
    finally:
        llm.engine.runner.__dict__.pop("move_kv", None)
        use(llm, None)
    assert got == plain
    drafted, accepted = stats.spec_num_draft_tokens - drafted, stats.spec_num_accepted_tokens - accepted
    assert drafted > 0
    if method == "draft_model":
        assert accepted > 0.9 * drafted, (accepted, drafted)
    if method == "oracle_tree":
        assert accepted > 2 * len(PROMPTS) and sum(moves) > 0


def test_shapes_that_do_not_split_are_refused():
    check_shape(9, 3, 1536, 3)  # the default model at TP=3
    check_shape(6, 1, 192, 3)  # one KV head, replicated
    with pytest.raises(ValueError, match="attention heads"):
        check_shape(9, 3, 1536, 2)
    with pytest.raises(ValueError, match="KV heads"):
        check_shape(6, 2, 192, 3)
    with pytest.raises(ValueError, match="intermediate"):
        check_shape(6, 2, 191, 2)
    assert [vocab_slice(98, 3, r) for r in range(3)] == [(0, 33, 33), (33, 33, 33), (66, 32, 33)]


# -- a worker that dies -----------------------------------------------------------------------------

def test_a_killed_worker_fails_generate_at_once(root):
    """SIGKILL a worker in the middle of generation: generate raises WorkerLost naming it,
    promptly, the other workers are stopped, and the engine refuses further work."""
    from specserve import LLM

    model_dir = root / "tp2"
    llm = build(LLM, model_dir if model_dir.exists() else write_model(model_dir, 2, False), 2)
    engine, workers = llm.engine, llm.engine.runner.tp.workers
    real_step, steps = engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 4:
            os.kill(workers.procs[0].pid, signal.SIGKILL)
        return real_step()

    engine.step = step
    start = time.monotonic()
    try:
        with pytest.raises(WorkerLost, match=r"worker 1 \(pid \d+\) was killed by SIGKILL"):
            llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        assert time.monotonic() - start < 30
        assert 4 <= len(steps) <= 6
        assert all(not p.is_alive() for p in workers.procs)
        with pytest.raises(WorkerLost):
            llm.generate(PROMPTS[:1], GREEDY)
    finally:
        engine.step = real_step
        workers.shutdown(kill=True)


def test_a_killed_worker_ends_the_server(root):
    """Under `specserve serve --tensor-parallel-size 2`: a stream in flight when a worker is
    killed ends with an error event, /health never says 200 again, the process exits 1."""
    from tests.server_fixtures import BackgroundStream, ServerProcess

    model_dir = root / "tp2"
    if not model_dir.exists():
        write_model(model_dir, 2, False)
    server = ServerProcess(["--model", str(model_dir), "--load-format", "dummy", "--max-model-len", "256",
                            "--num-blocks", "128", "--block-size", "4", "--speculative-config", "none",
                            "--tensor-parallel-size", "2", "--shutdown-timeout", "2"])
    try:
        body = {"model": str(model_dir), "prompt": [5, 9, 17, 33], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        worker = int(re.search(r"tensor parallelism: 2 ranks \(gloo\), workers (\d+)", server.log()).group(1))
        stream = BackgroundStream(server.base_url, {**body, "max_tokens": 250})
        assert stream.started.wait(60)
        os.kill(worker, signal.SIGKILL)
        assert stream.join(60) and stream.events[-1] == "[DONE]", stream.events[-3:]
        assert json.loads(stream.events[-2])["error"]["type"] == "service_unavailable"
        health = []
        for _ in range(5):
            try:
                health.append(httpx.get(f"{server.base_url}/health", timeout=5).status_code)
            except httpx.HTTPError:
                health.append(None)
        assert 200 not in health, health
        assert server.proc.wait(60) == 1, server.log()
        assert re.search(r"tensor-parallel worker 1 \(pid \d+\) was killed by SIGKILL", server.log())
    finally:
        server.stop()


# -- the default model ---------------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_at_tp3_with_the_shipped_eagle_head(llm, make_llm):
    """9 heads and 3 KV heads over 3 ranks: TP=1's greedy tokens, and the shipped EAGLE head
    (on rank 0, unsplit) gives the same tokens as plain decoding at TP=3."""
    prompts = [{"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": q}])}
               for q in ("Explain how a bicycle works.", "Write a haiku about autumn.")]
    params = SamplingParams(temperature=0, max_tokens=32)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    tp3 = make_llm(max_model_len=1024, tensor_parallel_size=3, speculative_config={
        "method": "eagle", "adaptive": False, "num_speculative_tokens": 8})
    try:
        got = [o.outputs[0].token_ids for o in tp3.generate(prompts, params)]
        use(tp3, None)
        plain = [o.outputs[0].token_ids for o in tp3.generate(prompts, params)]
    finally:
        tp3.engine.shutdown()
    assert got == plain == reference
    assert tp3.engine.stats.spec_num_accepted_tokens > 0
