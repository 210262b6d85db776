"""Data-parallel replicas (`--data-parallel-size`, server/replicas.py): two engine processes of
a tiny random model behind one real uvicorn server, driven by the official `openai` client.
Routing by prefix affinity shows in the per-replica prefix-cache metrics; greedy output equals
the single-engine server's; a replica killed with SIGKILL fails its requests, turns /health to
503 and ends the server with exit code 1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from specserve.server.replicas import PrefixAffinity, Replica, pick_replica
from tests.conftest import write_tiny_model
from tests.server_fixtures import BackgroundStream, ServerProcess, free_port

PROMPT_A = "The quick brown fox jumps over the lazy dog near the river bank. " * 14
PROMPT_B = "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod. " * 12
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return write_tiny_model(tmp_path_factory.mktemp("dp"), default_model_dir, with_weights=False)


def server_args(model_dir, replicas: int) -> list[str]:
    return ["--model", str(model_dir), "--load-format", "dummy", "--seed", "3",
            "--max-model-len", "512", "--num-blocks", "96", "--block-size", "16",
            "--shutdown-timeout", "2", "--data-parallel-size", str(replicas)]


@pytest.fixture(scope="module")
def dp2(model_dir):
    proc = ServerProcess(server_args(model_dir, 2))
    yield proc
    proc.stop()


def per_replica(server: ServerProcess, name: str) -> list[float]:
    return [server.metric(f"specserve:replica_{name}", replica=str(i)) for i in range(2)]


def test_the_openai_client_is_served_by_both_replicas(dp2, model_dir):
    client = dp2.openai()
    model = str(model_dir)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                          temperature=0, extra_body=NO_EOS)
    pieces, finish = [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                                temperature=0, stream=True, extra_body=NO_EOS):
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 12
    assert "".join(pieces) == chat.choices[0].message.content and finish == "length"

    done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10,
                                     temperature=0, extra_body=NO_EOS)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=10, temperature=0, extra_body=NO_EOS,
        stream=True) if c.choices)
    assert done.usage.completion_tokens == 10 and streamed == done.choices[0].text

    with pytest.raises(openai.BadRequestError, match="logit_bias"):  # the engine's own checks
        client.completions.create(model=model, prompt="Hi", max_tokens=2,
                                  logit_bias={"99999999": 1.0})

    aclient = dp2.async_openai()

    async def many() -> list[str]:
        async def one(i: int) -> str:
            r = await aclient.completions.create(model=model, prompt=f"Item {i}:", max_tokens=24,
                                                 temperature=0, extra_body=NO_EOS)
            return r.choices[0].text
        return await asyncio.gather(*(one(i) for i in range(8)))

    texts = asyncio.run(many())
    assert all(texts) and len(texts) == 8
    routed = per_replica(dp2, "requests_routed_total")
    assert min(routed) >= 2, routed  # both replicas served
    assert per_replica(dp2, "requests_in_flight") == [0, 0]
    assert dp2.metric("specserve:generation_tokens_total") == sum(
        per_replica(dp2, "generation_tokens_total"))
    kv = httpx.get(f"{dp2.base_url}/debug/kv", timeout=10).json()
    assert [r["alive"] for r in kv["replicas"]] == [True, True]
    assert kv["num_free_blocks"] == kv["num_total_blocks"] == 2 * 96


def test_a_repeated_prefix_goes_to_the_replica_that_holds_it(dp2, model_dir):
    """A runs while B arrives, so they land on different replicas (least loaded); every repeat
    of each then goes to the replica holding it, where its blocks are prefix-cache hits.
    Routing by load alone (fewest in flight, then fewest routed) cannot send all four home."""
    model = str(model_dir)
    client = dp2.openai()
    prompt_tokens = per_replica(dp2, "prompt_tokens_total")
    with httpx.stream("POST", f"{dp2.base_url}/v1/completions", timeout=60, json={
            "model": model, "prompt": PROMPT_A, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # A's first token: in flight on its replica
        client.completions.create(model=model, prompt=PROMPT_B, max_tokens=2, temperature=0)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    after = per_replica(dp2, "prompt_tokens_total")
    grew = [i for i in range(2) if after[i] > prompt_tokens[i]]
    assert grew == [0, 1], (prompt_tokens, after)  # one prompt each
    a_len = len(httpx.post(f"{dp2.base_url}/tokenize", json={"prompt": PROMPT_A}).json()["tokens"])
    b_len = len(httpx.post(f"{dp2.base_url}/tokenize", json={"prompt": PROMPT_B}).json()["tokens"])
    home_a = 0 if after[0] - prompt_tokens[0] == a_len else 1
    assert after[1 - home_a] - prompt_tokens[1 - home_a] == b_len

    hits, routed = per_replica(dp2, "prefix_cache_hits_total"), per_replica(dp2, "requests_routed_total")
    prefix_routed = dp2.metric("specserve:replica_requests_routed_total", reason="prefix")
    for prompt in (PROMPT_A, PROMPT_B, PROMPT_B, PROMPT_A):
        client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    hits_after = per_replica(dp2, "prefix_cache_hits_total")
    routed_after = per_replica(dp2, "requests_routed_total")
    assert routed_after[home_a] - routed[home_a] == 2 and routed_after[1 - home_a] - routed[1 - home_a] == 2
    assert dp2.metric("specserve:replica_requests_routed_total", reason="prefix") - prefix_routed == 4
    full_blocks = [(a_len - 1) // 16 * 16, (b_len - 1) // 16 * 16]  # the last token is computed
    assert hits_after[home_a] - hits[home_a] >= 2 * full_blocks[0], (hits, hits_after)
    assert hits_after[1 - home_a] - hits[1 - home_a] >= 2 * full_blocks[1], (hits, hits_after)
    rates = per_replica(dp2, "prefix_cache_hit_rate")
    assert min(rates) > 0.2, rates


def test_greedy_output_equals_the_single_engine_server(dp2, model_dir):
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,",
               "Write a haiku about snow."]
    single = ServerProcess(server_args(model_dir, 1))
    try:
        def run(server: ServerProcess) -> list[list[str]]:
            client = server.openai()
            texts = [client.completions.create(model=str(model_dir), prompt=p, max_tokens=20,
                                               temperature=0).choices[0].text for p in prompts]
            chats = [client.chat.completions.create(
                model=str(model_dir), messages=[{"role": "user", "content": p}], max_tokens=20,
                temperature=0).choices[0].message.content for p in prompts[:2]]
            return [texts, chats]

        routed = per_replica(dp2, "requests_routed_total")
        assert run(dp2) == run(single)
        moved = [a - b for a, b in zip(per_replica(dp2, "requests_routed_total"), routed)]
        assert min(moved) >= 2, moved  # both replicas answered some of them
    finally:
        assert single.stop() == 0


def test_pick_replica_prefers_the_prefix_holder_unless_it_is_much_busier():
    def replica(index: int, in_flight: int, routed: int = 0) -> Replica:
        r = Replica(index, None, None, None, routed=routed)
        r.live = {f"r{index}-{k}": None for k in range(in_flight)}
        return r

    affinity = PrefixAffinity(2, 4, capacity=8)
    keys = affinity.keys(list(range(20)))  # 5 blocks
    affinity.record(1, keys[:3])
    hits = [affinity.cached_blocks(i, keys) for i in range(2)]
    assert hits == [0, 3]
    idle = [replica(0, 0), replica(1, 0, routed=5)]
    assert pick_replica(idle, hits, slack=4)[0].index == 1
    assert pick_replica(idle, hits, slack=4)[1] == "prefix"
    busy = [replica(0, 1), replica(1, 6)]
    assert (pick_replica(busy, hits, slack=4)[0].index, pick_replica(busy, hits, slack=4)[1]) == (0, "load")
    assert pick_replica(busy, hits, slack=5)[0].index == 1
    assert pick_replica(idle, [0, 0], slack=4)[0].index == 0  # no hit: fewest routed so far
    affinity.record(0, affinity.keys(list(range(100, 140))))  # 10 blocks: the oldest go
    assert affinity.cached_blocks(0, affinity.keys(list(range(100, 140)))) == 0
    assert affinity.cached_blocks(0, affinity.keys(list(range(100, 140)))[:2]) == 0
    assert len(affinity.records[0]) == 8


def test_a_killed_replica_fails_its_requests_and_health_turns_503(model_dir):
    """In process, so /health can be read after the death (the CLI would exit): a stream on
    the killed replica ends with a service_unavailable error event, the other one runs on."""
    import uvicorn

    from specserve.config import EngineConfig
    from specserve.server.app import build_app
    from specserve.server.replicas import ReplicaRouter, launch_replicas

    config = EngineConfig.create(str(model_dir), load_format="dummy", seed=3, max_model_len=512,
                                 num_blocks=64, speculative_config=None)
    replicas = launch_replicas(config, 2, log_level="warning")
    router = ReplicaRouter(replicas, max_in_flight=64)
    deaths: list[BaseException] = []
    router.on_death = deaths.append
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(router, "tiny"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    results: dict[int, list[str]] = {}
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        first_event = [threading.Event(), threading.Event()]

        def stream(i: int) -> None:  # 0 runs on replica 0 (killed), 1 on replica 1
            body = {"model": "tiny", "prompt": f"Story number {i}:", "max_tokens": 480 - 320 * i,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_event[i].set()
                results[i] = events

        threads = []
        for i in range(2):
            threads.append(threading.Thread(target=stream, args=(i,)))
            threads[-1].start()
            assert first_event[i].wait(30)
        kv = httpx.get(f"{base}/debug/kv", timeout=10).json()
        assert kv["replicas"][0]["in_flight"] == 1, kv
        os.kill(kv["replicas"][0]["pid"], signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert all(not t.is_alive() for t in threads)
        errors = [json.loads(results[i][-2]).get("error", {}).get("type") for i in range(2)]
        assert errors == ["service_unavailable", None], results
        assert all(events[-1] == "[DONE]" for events in results.values())
        health = httpx.get(f"{base}/health", timeout=10)
        assert health.status_code == 503 and "replica 0" in health.json()["error"]["message"]
        refused = httpx.post(f"{base}/v1/completions", timeout=10,
                             json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert len(deaths) == 1 and "replica 0" in str(deaths[0])
        assert "replica_up" in httpx.get(f"{base}/metrics").text
    finally:
        server.should_exit = True
        thread.join(20)
        assert router.stop(10)


def test_zz_a_killed_replica_ends_the_server_with_exit_code_1(dp2, model_dir):
    """Runs last in the module: SIGKILL to one replica of the CLI server while a stream runs
    there: the stream ends with an error event, and the process exits 1 (no hang)."""
    kv_before = httpx.get(f"{dp2.base_url}/debug/kv", timeout=10).json()
    stream = BackgroundStream(dp2.base_url, {"model": str(model_dir), "prompt": "A long tale:", "max_tokens": 480,
                                             "temperature": 0, "ignore_eos": True})
    assert stream.started.wait(30), dp2.log()
    kv = httpx.get(f"{dp2.base_url}/debug/kv", timeout=10).json()
    victim = next(r for r in kv["replicas"] if r["in_flight"] == 1)
    assert victim["pid"] in [r["pid"] for r in kv_before["replicas"]]
    os.kill(victim["pid"], signal.SIGKILL)
    assert stream.join(60) and stream.events[-1] == "[DONE]"
    assert json.loads(stream.events[-2])["error"]["type"] == "service_unavailable", stream.events[-3:]
    assert dp2.proc.wait(60) == 1, dp2.log()
    assert f"replica {victim['replica']}" in dp2.log() and "died" in dp2.log()
