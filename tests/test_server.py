"""End-to-end tests of the OpenAI-compatible server: a real uvicorn process with the real
default model, driven by the official `openai` client (and httpx for raw SSE)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.server_fixtures import ServerProcess, default_model_args

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(default_model_args())
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def chat(client, content: str, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": content}], **kw)


def raw_sse(server, path: str, body: dict) -> list[str]:
    """The raw `data:` payloads of a streamed request, [DONE] included."""
    events = []
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=120,
                      headers=server.headers) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
            else:
                assert line == "", line
    return events


def test_models_list(client):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == MODEL
    assert len(ids) >= 1


def test_chat_non_stream(client):
    r = chat(client, "What is the capital of France?")
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == MODEL
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == MAX_TOKENS
    spec = r.usage.model_extra.get("speculation")
    assert spec is not None and set(spec) == {"num_draft_tokens", "num_accepted_tokens"}


def test_chat_stream_equals_non_stream(client, server):
    content = "Name three colors."
    reference = chat(client, content)
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    events = raw_sse(server, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == reference.usage.completion_tokens
    assert usage_chunk["usage"]["prompt_tokens"] == reference.usage.prompt_tokens
    content_chunks = chunks[:-1]
    assert all(c["usage"] is None for c in content_chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in content_chunks
                if c["choices"][0]["finish_reason"]]
    assert finishes == [reference.choices[0].finish_reason]
    assert content_chunks[-1]["choices"][0]["finish_reason"] is not None
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in content_chunks)
    assert text == reference.choices[0].message.content
    # a multi-byte character is never split across chunks (no replacement characters
    # appear that the full text does not have)
    if "\ufffd" not in text:
        assert all("\ufffd" not in (c["choices"][0]["delta"].get("content") or "")
                   for c in content_chunks)


def test_stream_via_openai_client_without_usage(client):
    reference = chat(client, "Say hello.")
    stream = chat(client, "Say hello.", stream=True)
    pieces, finish = [], []
    for chunk in stream:
        assert chunk.usage is None
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    assert "".join(pieces) == reference.choices[0].message.content
    assert len(finish) == 1


def test_list_of_text_parts_and_system_message(client, server):
    plain = chat(client, "Tell me a joke.")
    parts = client.chat.completions.create(
        model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me "},
                                               {"type": "text", "text": "a joke."}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"}]
    with_system = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                                 messages=messages)
    tokenized = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages},
                           timeout=30, headers=server.headers).json()
    assert with_system.usage.prompt_tokens == tokenized["count"]
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokenized["tokens"]},
                      timeout=30, headers=server.headers).json()["prompt"]
    assert "You are terse." in text and "Hello." in text


def test_n2_and_seed_reproducible(client):
    kw = dict(n=2, temperature=1.0, seed=1234, max_tokens=8)
    a = chat(client, "Write a word.", **kw)
    b = chat(client, "Write a word.", **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert 2 <= a.usage.completion_tokens <= 16


def test_stop_string(client):
    reference = chat(client, "Count from one to ten in words.", max_tokens=16)
    text = reference.choices[0].message.content
    assert len(text) > 6, text
    stop = text[3:6]
    cut = text[:text.index(stop)]
    stopped = chat(client, "Count from one to ten in words.", max_tokens=16, stop=[stop])
    assert stopped.choices[0].message.content == cut
    assert stopped.choices[0].finish_reason == "stop"
    streamed = chat(client, "Count from one to ten in words.", max_tokens=16, stop=stop,
                    stream=True)
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(pieces) == cut


def test_chat_logprobs(client):
    r = chat(client, "Hi there", logprobs=True, top_logprobs=3, max_tokens=6)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.bytes is not None
        # greedy: the sampled token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-4


def test_completions_forms(client, server):
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6,
                                  temperature=0)
    assert r.object == "text_completion"
    text = r.choices[0].text
    assert r.usage.completion_tokens <= 6
    ids = server_tokenize(server, "The sky is")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == text
    assert by_ids.usage.prompt_tokens == len(ids)
    many = client.completions.create(model=MODEL, prompt=["The sky is", "Water is"],
                                     max_tokens=6, temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == text == many.choices[1].text
    lists = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=6,
                                      temperature=0)
    assert [c.text for c in lists.choices] == [text, text]
    echo = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6,
                                     temperature=0, echo=True)
    assert echo.choices[0].text == "The sky is" + text


def server_tokenize(server, text: str) -> list[int]:
    r = httpx.post(f"{server.base_url}/tokenize", json={"model": MODEL, "prompt": text},
                   timeout=30, headers=server.headers)
    r.raise_for_status()
    body = r.json()
    assert body["count"] == len(body["tokens"])
    back = httpx.post(f"{server.base_url}/detokenize", json={"tokens": body["tokens"]},
                      timeout=30, headers=server.headers).json()
    assert back["prompt"] == text
    return body["tokens"]


def test_completions_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=5,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)


def test_completions_stream(client):
    reference = client.completions.create(model=MODEL, prompt="Once upon a time",
                                          max_tokens=8, temperature=0)
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        pieces += [c.text for c in chunk.choices]
    assert "".join(pieces) == reference.choices[0].text
    assert usage.completion_tokens == reference.usage.completion_tokens


def test_abort_on_disconnect(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body,
                      timeout=60, headers=server.headers) as r:
        lines = r.iter_lines()  # kept alive: closing it would close the connection early
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: ")
        assert server.metric("specserve:num_requests_running") >= 1
        assert server.metric("specserve:kv_cache_usage_perc") > 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if (server.metric("specserve:num_requests_running") == 0
                and server.metric("specserve:kv_cache_usage_perc") == 0):
            break
        time.sleep(0.2)
    assert server.metric("specserve:num_requests_running") == 0
    assert server.metric("specserve:kv_cache_usage_perc") == 0.0
    kv = httpx.get(f"{server.base_url}/debug/kv", timeout=10).json()
    if kv.get("num_total_blocks") is not None:
        assert kv["num_free_blocks"] == kv["num_total_blocks"] or kv["kv_cache_usage"] == 0


def test_32_concurrent_streams(server):
    prompts = ["Name a fruit.", "Name an animal.", "What is 2+2?", "Say something nice."]
    client = server.async_openai()

    async def one(prompt: str, stream: bool) -> str:
        kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8,
                  temperature=0)
        if not stream:
            r = await client.chat.completions.create(**kw)
            return r.choices[0].message.content
        pieces, finishes = [], 0
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                pieces.append(c.delta.content or "")
                finishes += c.finish_reason is not None
        assert finishes == 1
        return "".join(pieces)

    async def main():
        refs = await asyncio.gather(*(one(p, False) for p in prompts))
        outs = await asyncio.gather(*(one(prompts[i % 4], True) for i in range(32)))
        return refs, outs

    refs, outs = asyncio.run(main())
    for i, text in enumerate(outs):
        assert text == refs[i % 4], (i, text, refs[i % 4])


def test_metrics_move(server, client):
    before = server.metric("specserve:generation_tokens_total", model_name=MODEL)
    chat(client, "Hello!", max_tokens=4)
    text = server.metrics_text()
    for name in ("specserve:num_requests_running", "specserve:num_requests_waiting",
                 "specserve:kv_cache_usage_perc", "specserve:prompt_tokens_total",
                 "specserve:generation_tokens_total", "specserve:request_success_total",
                 "specserve:time_to_first_token_seconds_count",
                 "specserve:inter_token_latency_seconds_count",
                 "specserve:e2e_request_latency_seconds_count",
                 "specserve:spec_decode_num_drafts_total"):
        assert f"\n{name}{{" in text, name
    assert server.metric("specserve:generation_tokens_total", model_name=MODEL) >= before + 1
    assert server.metric("specserve:prompt_tokens_total") > 0
    assert server.metric("specserve:request_success_total", finished_reason="length") >= 1
    assert server.metric("specserve:e2e_request_latency_seconds_count") >= 1
    assert server.metric("specserve:time_to_first_token_seconds_count") >= 1


def test_bench_serve_against_server(server, tmp_path):
    import argparse

    from specserve.bench import serving as bench

    args = bench.add_args(argparse.ArgumentParser()).parse_args(
        ["--base-url", server.base_url, "--num-prompts", "4", "--max-tokens", "4",
         "--request-rate", "20", "--result-json", str(tmp_path / "r.json"),
         "--plot", str(tmp_path / "r.png")])
    assert bench.run(args) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    assert 0 < result["output_tokens"] <= 16
    assert result["ttft_s"]["p50"] > 0 and result["e2e_s"]["p99"] >= result["e2e_s"]["p50"]
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_eagle_out_of_the_box_streams_the_plain_greedy_text(server, client, llm):
    """The default server (EAGLE with the shipped head): a streamed greedy answer equals plain
    decoding's (the session's plain engine, same chat template), and drafts were verified (how
    many were accepted depends on the machine: where speculation measures slower it is switched
    off)."""
    from specserve import SamplingParams

    prompt = "Write three sentences about the history of bicycles."
    want = llm.chat([{"role": "user", "content": prompt}],
                    SamplingParams(temperature=0, max_tokens=48))[0].outputs[0].text
    drafts = server.metric("specserve:spec_decode_num_drafts_total", model_name=MODEL)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    spec = chunks[-1].usage.model_extra["speculation"]
    assert spec["num_draft_tokens"] > 0
    assert server.metric("specserve:spec_decode_num_drafts_total", model_name=MODEL) > drafts
    assert server.metric("specserve:spec_decode_steps_total", model_name=MODEL, kind="drafting") > 0
