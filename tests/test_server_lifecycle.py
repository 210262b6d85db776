"""The server's limits and its ends: a KV cache smaller than the context, SIGTERM while streams
run, an engine thread that dies, and the refusal to listen on the
network without a key. Each test that stops its server starts its own (tests/fault_server.py:
the real server with faults a prompt can inject)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server_fixtures import REPO, ServerProcess, default_model_args

MODEL = "smollm2-135m-instruct"
GET = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def fault_server(args: list[str]) -> ServerProcess:
    os.environ["SPECSERVE_TEST_SERVER_ENTRY"] = str(REPO / "tests" / "fault_server.py")
    os.environ["FAULT_STALL_SECONDS"] = "7"
    try:
        return ServerProcess(args)
    finally:
        del os.environ["SPECSERVE_TEST_SERVER_ENTRY"]


def chat(content: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            **kw}


def sse_events(r: httpx.Response) -> list[str]:
    return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def small_kv():
    """A 2,048-token context over a KV cache of 12 blocks (192 tokens), a 0.3 s grace period on
    SIGTERM (well under the ~1 s a 120-token stream takes at ~130 tok/s: the stream must outlast
    it), 2 s for a request's head and 2 s for its body, 8 connections per client."""
    proc = ServerProcess(["--max-model-len", "2048", "--num-blocks", "12", "--block-size", "16",
                          "--shutdown-timeout", "0.3", "--timeout-request-head", "2",
                          "--timeout-request-body", "2", "--max-connections-per-client", "8"])
    yield proc
    proc.stop()


def test_without_max_tokens_a_request_runs_to_what_the_kv_cache_holds(small_kv):
    r = httpx.post(f"{small_kv.base_url}/v1/chat/completions",
                   json=chat("Count from one to a thousand.", ignore_eos=True), timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    total = body["usage"]["total_tokens"]
    assert 150 < total < 192, body["usage"]
    too_many = httpx.post(f"{small_kv.base_url}/v1/chat/completions",
                          json=chat("Hi", max_tokens=500), timeout=60)
    assert too_many.status_code == 400 and "KV cache" in too_many.json()["error"]["message"]


def test_an_idle_connection_outlives_the_clients_own_idle_timeout(small_kv):
    """httpx (and so the openai client) reuses a pooled connection idle for up to 5 s; a server
    that closes idle connections at 5 s races it, and the request sent as it closes fails with
    a connection error. A request 6 s after the last one on the same connection gets its answer."""
    with connect(small_kv) as sock:
        sock.sendall(GET)
        assert answer(sock)[0].startswith(b"HTTP/1.1 200")
        time.sleep(6)
        sock.sendall(GET)
        assert answer(sock)[0].startswith(b"HTTP/1.1 200")


def connect(server: ServerProcess, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=(source, 0))


def answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """The next response on `sock`: its head and its body (of its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the connection"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(4096)
    return head, body


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (reading past any bytes of an earlier
    response still unread)."""
    sock.settimeout(seconds)
    try:
        data = sock.recv(4096)
        while data:
            data = sock.recv(4096)
        return True
    except TimeoutError:
        return False


def test_a_connection_that_sends_no_whole_request_head_is_closed(small_kv):
    """Connections that send nothing, half a request line, or half the next request after a
    response are closed once --timeout-request-head (2 s) has passed, while a request on
    another connection is answered; a whole request that was sent slowly within it is answered."""
    silent, half, next_half, slow = (connect(small_kv) for _ in range(4))
    half.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    next_half.sendall(GET)
    next_half.settimeout(10)
    assert next_half.recv(4096).startswith(b"HTTP/1.1 200")
    next_half.sendall(b"GET /health HT")
    slow.sendall(b"GET /health HTTP/1.1\r\n")
    time.sleep(1)
    slow.sendall(b"Host: 127.0.0.1\r\n\r\n")
    slow.settimeout(10)
    assert slow.recv(4096).startswith(b"HTTP/1.1 200")
    assert httpx.get(f"{small_kv.base_url}/health", timeout=10).status_code == 200
    for sock in (silent, half, next_half):
        with sock:
            assert closed_within(sock, 6)
    slow.close()


def test_a_request_whose_body_does_not_arrive_in_time_is_closed(small_kv):
    """A request whose head announces a body that arrives only in part, or not at all, is closed
    once --timeout-request-body (2 s) has passed, without an error in the server's log; a body
    sent in two halves 1 s apart is answered, and so is a request on another connection."""
    body = json.dumps(chat("Hi", max_tokens=1)).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()

    no_body, part, slow = (connect(small_kv) for _ in range(3))
    no_body.sendall(head)
    part.sendall(head + body[:10])
    slow.sendall(head + body[:10])
    time.sleep(1)
    slow.sendall(body[10:])
    slow.settimeout(30)
    assert slow.recv(4096).startswith(b"HTTP/1.1 200")
    assert httpx.post(f"{small_kv.base_url}/v1/chat/completions", json=chat("Hi", max_tokens=1),
                      timeout=30).status_code == 200
    for sock in (no_body, part):
        with sock:
            assert closed_within(sock, 6)
    slow.close()
    assert "Traceback" not in small_kv.log()


def test_a_client_past_its_connection_cap_gets_429_while_others_are_served(small_kv):
    """A client (127.0.0.1) holding --max-connections-per-client (8) kept-alive connections gets
    HTTP 429 with an OpenAI-style error body on the next and that one is closed; another client
    (127.0.0.2) is served meanwhile, and once one of the 8 closes the first is served again."""
    time.sleep(0.5)  # (connections of the tests before have been closed by then)
    held = [connect(small_kv) for _ in range(8)]
    for sock in held:  # each served: a kept-alive connection, idle between requests
        sock.sendall(GET)
        assert answer(sock)[0].startswith(b"HTTP/1.1 200")
    with connect(small_kv) as extra:
        head, body = answer(extra)
        assert head.startswith(b"HTTP/1.1 429"), head
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert closed_within(extra, 5)
    with connect(small_kv, "127.0.0.2") as other:
        other.sendall(GET)
        assert answer(other)[0].startswith(b"HTTP/1.1 200")
    held.pop().close()
    deadline = time.monotonic() + 10
    while True:  # (the server sees the close a moment later)
        try:
            if httpx.get(f"{small_kv.base_url}/health", timeout=10).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the freed connection was not counted as closed"
        time.sleep(0.1)
    for sock in held:
        sock.close()
    assert "Traceback" not in small_kv.log()


def test_zz_sigterm_ends_running_streams_cleanly_and_exits_0(small_kv):
    """Runs last in the module: SIGTERM while a long stream runs. New requests get 503; the
    stream ends after the grace period with an error event and [DONE]; exit 0."""
    events: list[str] = []
    body = chat("Write a very long story about a dragon.", stream=True, max_tokens=120,
                ignore_eos=True)

    def stream() -> None:
        with httpx.stream("POST", f"{small_kv.base_url}/v1/chat/completions", json=body,
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])

    t = threading.Thread(target=stream)
    with httpx.Client(base_url=small_kv.base_url, timeout=30) as client:
        assert client.get("/health").status_code == 200  # an open keep-alive connection
        t.start()
        deadline = time.monotonic() + 30
        while not events and time.monotonic() < deadline:
            time.sleep(0.05)
        small_kv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:
            status = client.post("/v1/chat/completions", json=chat("Hi", max_tokens=2)).status_code
        except httpx.TransportError:
            status = None  # the connection was already closed: also a refusal
        assert status in (503, None), status
    t.join(60)
    rc = small_kv.proc.wait(60)
    assert rc == 0, small_kv.log()
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down", error


def test_an_engine_thread_that_dies_exits_the_process_non_zero():
    server = fault_server(default_model_args(256))
    try:
        results: dict = {}

        def normal() -> None:
            with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60,
                              json=chat("Tell me about the sea.", stream=True, max_tokens=200,
                                        ignore_eos=True)) as r:
                results["events"] = sse_events(r)

        t = threading.Thread(target=normal)
        t.start()
        time.sleep(1.0)
        r = httpx.post(f"{server.base_url}/v1/chat/completions",
                       json=chat("FAULT-KILL now", max_tokens=4), timeout=60)
        assert r.status_code == 503, r.text
        t.join(60)
        assert results["events"][-1] == "[DONE]"
        assert json.loads(results["events"][-2])["error"]["type"] == "service_unavailable"
        assert server.proc.wait(60) == 1, server.log()
        assert "engine thread died" in server.log()
    finally:
        server.stop()


def test_no_key_on_a_network_address_is_refused_at_start():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("SPECSERVE_API_KEY", None)
    r = subprocess.run([sys.executable, "-m", "specserve.server", "--host", "0.0.0.0",
                        "--require-api-key"], capture_output=True, text=True, env=env,
                       timeout=120, cwd=str(REPO))
    assert r.returncode == 2
    assert "without an API key" in r.stderr


@pytest.mark.parametrize("args, message", [
    *[([flag, "0"], f"{flag} must be more than 0 seconds")
      for flag in ("--timeout-request-head", "--timeout-request-body", "--timeout-keep-alive")],
    (["--max-connections-per-client", "-1"], "--max-connections-per-client must be 0 (no cap) or more")])
def test_a_limit_out_of_range_is_refused_at_start(args, message, capsys):
    """(In this process: the checks run before any model loads; the test above runs the real
    entry point for its exit code.)"""
    from specserve.server.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err, err
