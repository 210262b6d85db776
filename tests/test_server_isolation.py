"""No request can hurt another: each hostile or broken request gets a clear error of its own
while a normal stream beside it comes out token for token as it does alone.

One real server (the default model, speculation on) with faults that a prompt can inject into
the engine step (tests/fault_server.py), a small admission limit (4 running + 4 queued) and a
short stall limit for /health.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import pytest

from tests.server_fixtures import REPO, ServerProcess, default_model_args

MODEL = "smollm2-135m-instruct"
NORMAL = {"model": MODEL, "messages": [{"role": "user", "content": "Write a short poem about rivers."}],
          "max_tokens": 40, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def server():
    os.environ["SPECSERVE_TEST_SERVER_ENTRY"] = str(REPO / "tests" / "fault_server.py")
    os.environ["FAULT_STALL_SECONDS"] = "5"
    try:
        proc = ServerProcess(default_model_args(256) + [
            "--max-num-seqs", "4", "--max-queued-requests", "4", "--health-stall-timeout", "2"])
    finally:
        del os.environ["SPECSERVE_TEST_SERVER_ENTRY"]
    yield proc
    proc.stop()


def stream_text(server, body: dict) -> tuple[str, list[dict]]:
    """A streamed chat call: (its text, its error events)."""
    text, errors = [], []
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
            for choice in event.get("choices", []):
                text.append(choice["delta"].get("content") or "")
    return "".join(text), errors


@pytest.fixture(scope="module")
def alone(server) -> str:
    text, errors = stream_text(server, NORMAL)
    assert text and not errors
    return text


def beside(server, alone: str, hostile) -> object:
    """Run `hostile()` while a normal stream runs; the stream must equal its text alone."""
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(zip(("text", "errors"), stream_text(server, NORMAL))))
    t.start()
    try:
        return hostile()
    finally:
        t.join(120)
        assert result.get("errors") == [] and result.get("text") == alone, result


def post(server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=timeout)


def assert_400(r: httpx.Response, param: str | None) -> dict:
    assert r.status_code == 400, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    return err


def chat(content: str = "Hi", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0, **kw}


@pytest.mark.parametrize("top_k", [2**63, 10**30])
def test_top_k_past_the_vocabulary_is_400(server, alone, top_k):
    r = beside(server, alone, lambda: post(server, "/v1/chat/completions",
                                           chat(temperature=1, top_k=top_k)))
    assert "top_k" in assert_400(r, "top_k")["message"]


def test_stop_token_ids_outside_the_vocabulary_are_400(server, alone):
    r = beside(server, alone, lambda: post(server, "/v1/chat/completions",
                                           chat(min_tokens=2, stop_token_ids=[10**9])))
    assert_400(r, "stop_token_ids")


def test_deeply_nested_json_schema_is_400_and_the_engine_lives(server, alone):
    r = beside(server, alone, lambda: post(server, "/v1/chat/completions",
                                           chat(guided_json="[" * 5000)))
    assert_400(r, "guided_json")
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    ok = post(server, "/v1/chat/completions", chat())
    assert ok.status_code == 200, ok.text


def test_huge_choice_list_is_400_at_once(server, alone):
    body = chat(guided_choice=[f"choice number {i}" for i in range(200_000)])
    r = beside(server, alone, lambda: post(server, "/v1/chat/completions", body))
    err = assert_400(r, "guided_choice")
    assert "panic" not in err["message"].lower() and "backtrace" not in err["message"].lower()


def test_prompts_times_n_past_capacity_is_400_before_tokenizing(server, alone):
    body = {"model": MODEL, "prompt": ["Once upon a time"] * 2000, "n": 128, "max_tokens": 2}
    r = beside(server, alone, lambda: post(server, "/v1/completions", body))
    assert_400(r, "n")
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_over_capacity_is_429_with_retry_after(server):
    """4 running + 4 queued: a call of 6 sequences holds most of it; 3 more do not fit."""
    body = {"model": MODEL, "prompt": "Count to fifty:", "n": 6, "max_tokens": 48,
            "temperature": 1, "seed": 1, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # admitted and running
        busy = post(server, "/v1/completions", {**body, "n": 3, "stream": False})
        assert busy.status_code == 429, busy.text
        assert int(busy.headers["retry-after"]) >= 1
        assert busy.json()["error"]["type"] == "rate_limit_error"
        assert post(server, "/v1/completions", {**body, "n": 2, "stream": False,
                                                "max_tokens": 2}).status_code == 200
        for _ in lines:
            pass


def test_many_long_stop_strings_are_400(server, alone):
    body = chat(stop=["x" * 2000 + str(i) for i in range(1000)], n=4)
    r = beside(server, alone, lambda: post(server, "/v1/chat/completions", body))
    assert_400(r, "stop")


def test_legal_stop_strings_do_not_slow_others(server, alone):
    """64 stop strings of 1,024 characters (the limits) on 2 sequences beside a normal stream:
    the stop check costs each new character a bounded amount, whatever the strings."""
    body = chat("Tell me a story.", stop=[f"{i:04d}" + "z" * 1020 for i in range(64)], n=2,
                max_tokens=32)
    r = beside(server, alone, lambda: post(server, "/v1/chat/completions", body))
    assert r.status_code == 200, r.text
    assert all(c["finish_reason"] == "length" for c in r.json()["choices"])


def test_huge_tokenize_is_400_before_tokenizing(server, alone):
    body = {"prompt": "word " * (12_000_000 // 5)}  # 12 MB: past any context
    r = beside(server, alone, lambda: post(server, "/tokenize", body))
    assert_400(r, "prompt")


def test_gbnf_grammar_constrains(server):
    grammar = 'root ::= "yes" | "no"'
    r = post(server, "/v1/chat/completions", chat("Is water wet?", guided_grammar=grammar,
                                                  max_tokens=8))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_suffix_is_400_not_ignored(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "def f(", "suffix": "return x",
                                         "max_tokens": 4})
    assert_400(r, "suffix")


def test_a_failing_step_fails_only_its_request(server, alone):
    """A step that raises whenever one request is in it: that request alone gets a generic
    error (its details stay in the log); the normal stream beside it is untouched."""
    body = chat("FAULT-RAISE please", max_tokens=8, stream=True)

    text, errors = beside(server, alone, lambda: stream_text(server, body))
    assert len(errors) == 1 and errors[0]["type"] == "internal_error", errors
    assert "secret detail" not in errors[0]["message"] and "RuntimeError" not in errors[0]["message"]
    r = post(server, "/v1/chat/completions", chat("FAULT-RAISE again"))
    assert r.status_code == 500 and "secret" not in r.text
    assert "secret detail" in server.log()  # the operator sees it
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert post(server, "/v1/chat/completions", chat()).status_code == 200


def test_health_is_503_while_the_engine_is_stuck(server):
    """A step stalls for 5 s (injected); /health (stall limit 2 s) says so, then recovers."""
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "r", post(server, "/v1/chat/completions", chat("FAULT-STALL now"))))
    t.start()
    seen = set()
    deadline = time.monotonic() + 30
    while t.is_alive() and time.monotonic() < deadline:
        r = httpx.get(f"{server.base_url}/health", timeout=5)
        seen.add(r.status_code)
        if r.status_code == 503:
            assert "step" in r.json()["error"]["message"]
        time.sleep(0.2)
    t.join(60)
    assert result["r"].status_code == 200
    assert 503 in seen, seen
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_a_failed_request_keeps_the_connection_open(server):
    """After a request failed inside the engine (a 500) the client's keep-alive connection
    still serves it."""
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        first = client.post("/v1/chat/completions", json=chat("FAULT-RAISE keepalive"))
        assert first.status_code == 500
        sock = first.extensions["network_stream"].get_extra_info("socket")
        second = client.post("/v1/chat/completions", json=chat())
        assert second.status_code == 200
        assert second.extensions["network_stream"].get_extra_info("socket") is sock


def test_a_client_that_stops_reading_does_not_slow_others(server, alone):
    """A stream whose client never reads (the server holds one pending output per request for
    it: tests/test_async_engine.py) beside a normal stream."""
    body = {"model": MODEL, "prompt": "List every number from 1 to 1000:", "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True}
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    try:
        beside(server, alone, lambda: time.sleep(1))
    finally:
        sock.close()
    assert httpx.get(f"{server.base_url}/health").status_code == 200
