"""A bounded soak: one loopback server under normal streams, every kind of hostile input the
isolation tests send, and clients that disconnect mid-prefill, mid-speculation and while the
KV pool is so small that requests are preempted. At the end every normal stream must equal its
text alone, every KV block must be back in the pool, /health must have said 200 throughout,
and the server's memory must not have grown with the traffic.

`python -m pytest -q tests/test_soak.py -s` prints the figures docs/server.md quotes.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import pytest

from tests.server_fixtures import ServerProcess, default_model_args

MODEL = "smollm2-135m-instruct"
PROMPTS = ["Write a short poem about rivers.", "Explain what a CPU cache is.",
           "List three uses of copper.", "Describe a sunrise in two sentences.",
           "What is the capital of Peru?", "Give me a haiku about snow.",
           "How do bees make honey?", "Why is the sky blue?"]
MAX_TOKENS = 48
ROUNDS = 3  # normal streams: ROUNDS x len(PROMPTS)
SPREAD_S = 5.0  # every request of a round starts within this many seconds
# a crowd that starts at once at the beginning of each round: streams that never stop early
# and together need several times the pool, so running requests are preempted (and must still
# come out as they do alone) whatever this machine's speed
CROWD = PROMPTS[:4] * 2
CROWD_TOKENS = 96


def hostile_bodies() -> list[tuple[str, dict]]:
    """(path, body) of each bad input the isolation tests send, one of each kind."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return [
        ("/v1/chat/completions", {**chat, "temperature": 1, "top_k": 2**63}),
        ("/v1/chat/completions", {**chat, "min_tokens": 2, "stop_token_ids": [10**9]}),
        ("/v1/chat/completions", {**chat, "guided_json": "[" * 5000}),
        ("/v1/chat/completions", {**chat, "guided_choice": [f"c{i}" for i in range(200_000)]}),
        ("/v1/completions", {"model": MODEL, "prompt": ["x"] * 2000, "n": 128, "max_tokens": 2}),
        ("/v1/chat/completions", {**chat, "stop": ["s" * 2000 + str(i) for i in range(1000)], "n": 4}),
        ("/tokenize", {"prompt": "word " * 2_400_000}),
        ("/v1/chat/completions", {**chat, "guided_grammar": "root ::= ( broken"}),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}),
        ("/v1/chat/completions", {**chat, "logit_bias": {"99999999": 5}}),
        ("/v1/chat/completions", {**chat, "max_tokens": 10**6}),
    ]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def normal_stream(client, prompt: str, crowd: bool = False) -> tuple[str, float]:
    """(text, the longest gap between two chunks after the first) of a greedy stream; a crowd
    stream runs to CROWD_TOKENS whatever it generates."""
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}],
        max_tokens=CROWD_TOKENS if crowd else MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True} if crowd else None)
    text, gap, last = [], 0.0, None
    async for chunk in stream:
        now = time.monotonic()
        if last is not None and text:
            gap = max(gap, now - last)
        last = now
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    return "".join(text), gap


async def disconnect(http: httpx.AsyncClient, when: str, prompt: str) -> None:
    """A stream the client abandons: before its first token (mid-prefill, a long prompt) or
    after a few chunks (mid-decode: drafting and verifying, or preempted)."""
    long_prompt = (prompt + " ") * (20 if when == "prefill" else 1)
    body = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}],
            "max_tokens": 64, "temperature": 0, "stream": True, "ignore_eos": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if when == "prefill":
            await asyncio.sleep(0.05)
            return
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= 24:
                return


@pytest.fixture(scope="module")
def server():
    # a pool of 20 blocks (320 tokens) for up to 8 sequences of up to 256: preemptions happen
    proc = ServerProcess(default_model_args(256)[:2] + ["--max-num-seqs", "8", "--num-blocks", "20"])
    yield proc
    proc.stop()


def test_soak(server):
    figures = asyncio.run(soak(server))
    print("\nsoak figures:", json.dumps(figures, indent=1))
    assert figures["normal_mismatches"] == 0
    assert figures["health_not_ok"] == 0
    assert figures["hostile_5xx"] == 0
    assert figures["kv_blocks_leaked"] == 0
    assert figures["preemptions"] > 0, "the pool was meant to be small enough to preempt"
    assert figures["rss_growth_mb"] < 50


async def soak(server) -> dict:
    """Two rounds of the same mix: the second's memory is compared with the first's end (the
    first warms up what any traffic allocates once: batch shapes, caches, grammar engine)."""
    client = server.async_openai(timeout=300)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
        alone = {}
        for prompt in PROMPTS:  # references, one at a time
            alone[prompt], _ = await normal_stream(client, prompt)
        for prompt in set(CROWD):
            alone["crowd", prompt], _ = await normal_stream(client, prompt, crowd=True)
        first = await soak_round(client, http, alone, random.Random(0))
        rss_warm = rss_mb(server.proc.pid)
        second = await soak_round(client, http, alone, random.Random(1))
        figures = {k: (first[k] + second[k] if isinstance(first[k], (int, float)) else second[k])
                   for k in first}
        figures["max_stall_s"] = max(first["max_stall_s"], second["max_stall_s"])
        figures["rss_mb_after_round_1"] = round(rss_warm)
        figures["rss_growth_mb"] = round(rss_mb(server.proc.pid) - rss_warm, 1)
        metrics = (await http.get("/metrics")).text
        figures["preemptions"] = int(sum(float(line.split()[-1]) for line in metrics.splitlines()
                                         if line.startswith("specserve:num_preemptions_total")))
        return figures


async def soak_round(client, http: httpx.AsyncClient, alone: dict[str, str], rng: random.Random) -> dict:
    health = {"ok": 0, "not_ok": 0}
    done = asyncio.Event()

    async def watch_health() -> None:
        while not done.is_set():
            r = await http.get("/health")
            health["ok" if r.status_code == 200 else "not_ok"] += 1
            await asyncio.sleep(0.25)

    statuses: list[int] = []

    async def later(coro, delay: float):
        await asyncio.sleep(delay)
        return await coro

    async def send_hostile(path: str, body: dict) -> None:
        statuses.append((await http.post(path, json=body)).status_code)

    kinds = ["prefill", "decode"] * 8
    normals = [later(normal_stream(client, p), rng.uniform(0, SPREAD_S)) for p in PROMPTS * ROUNDS]
    crowd = [normal_stream(client, p, crowd=True) for p in CROWD]
    hostile = [later(send_hostile(p, b), rng.uniform(0, SPREAD_S)) for p, b in hostile_bodies()]
    disconnects = [later(disconnect(http, kind, PROMPTS[i % len(PROMPTS)]), rng.uniform(0, SPREAD_S))
                   for i, kind in enumerate(kinds)]
    watcher = asyncio.create_task(watch_health())
    start = time.monotonic()
    results = await asyncio.gather(*crowd, *normals, *hostile, *disconnects)
    elapsed = time.monotonic() - start
    done.set()
    await watcher

    outs = results[:len(crowd) + len(normals)]
    keys = [("crowd", p) for p in CROWD] + PROMPTS * ROUNDS
    mismatches = sum(text != alone[key] for (text, _), key in zip(outs, keys))
    for _ in range(300):  # idle: every block back
        kv = (await http.get("/debug/kv")).json()
        if kv["num_running"] == 0 and kv["num_waiting"] == 0:
            break
        await asyncio.sleep(0.1)
    return {
        "seconds": round(elapsed, 1),
        "normal_streams": len(outs), "normal_mismatches": mismatches,
        "max_stall_s": round(max(gap for _, gap in outs), 2),
        "hostile_requests": len(statuses), "hostile_statuses": sorted(set(statuses)),
        "hostile_5xx": sum(s >= 500 for s in statuses),
        "disconnects": len(disconnects),
        "health_checks": health["ok"] + health["not_ok"], "health_not_ok": health["not_ok"],
        "kv_blocks_leaked": kv["num_total_blocks"] - kv["num_free_blocks"],
    }
