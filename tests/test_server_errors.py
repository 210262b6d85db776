"""Error handling of the server (OpenAI error bodies and status codes), the API key, and a
graceful SIGTERM. One server with --api-key and the real default model; the SIGTERM test stops
it and so runs last. The schemathesis fuzz test (marked slow) starts its own server."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from tests.server_fixtures import ServerProcess, default_model_args

MODEL = "smollm2-135m-instruct"
KEY = "test-key-123"
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(default_model_args(MAX_MODEL_LEN), api_key=KEY)
    yield proc
    proc.stop()


def post(server, path: str, body=None, *, content: bytes | None = None, key: str | None = KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if content is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(f"{server.base_url}{path}", content=content, headers=headers,
                          timeout=60)
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60)


def assert_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    if param != "any":
        assert err["param"] == param, err
    return err


def chat_body(**overrides):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "temperature": 0}
    body.update(overrides)
    return body


@pytest.mark.parametrize("overrides, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"n": 0}, "n"),
    ({"top_p": 0}, "top_p"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "any"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"stop": [""]}, "stop"),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),
    ({"max_tokens": 10_000}, "max_tokens"),
])
def test_chat_bad_params_400(server, overrides, param):
    assert_error(post(server, "/v1/chat/completions", chat_body(**overrides)), 400, param)


def test_chat_missing_messages_and_wrong_types_400(server):
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL}), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", [1, 2, 3]), 400)
    assert_error(post(server, "/v1/chat/completions", chat_body(messages="hi")), 400)


def test_malformed_json_400(server):
    err = assert_error(post(server, "/v1/chat/completions", content=b'{"model": '), 400)
    assert "JSON" in err["message"]
    assert_error(post(server, "/v1/completions", content=b"\xff\xfe"), 400)


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": list(range(5, 5 + MAX_MODEL_LEN))}, "prompt"),
    ({"prompt": {"a": 1}}, "any"),
])
def test_completions_bad_params_400(server, body, param):
    assert_error(post(server, "/v1/completions", {"model": MODEL, **body}), 400, param)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "a\ud800b"}]),
     "messages.0.content"),
    ("/v1/chat/completions", chat_body(stop=["\udfff"]), "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"prompt": "x\udc00"}, "prompt"),
])
def test_lone_surrogates_400(server, path, body, param):
    """JSON may escape half a UTF-16 pair (\\ud800); no tokenizer takes the string it decodes
    to, so it is a 400 naming the field, not a 500 from the tokenizer."""
    import json
    content = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as an escape
    assert b"\\u" in content
    err = assert_error(post(server, path, content=content), 400, param)
    assert "Unicode" in err["message"] and not err["message"].startswith("Value error")
    # a valid pair of surrogate escapes is one character (U+1F600) and is accepted
    ok = post(server, "/v1/chat/completions", content=json.dumps(
        chat_body(messages=[{"role": "user", "content": "\U0001F600"}])).encode())
    assert ok.status_code == 200, ok.text


def test_unknown_model_404(server):
    err = assert_error(post(server, "/v1/chat/completions", chat_body(model="gpt-9")), 404,
                       "model")
    assert err["code"] == "model_not_found"
    assert_error(post(server, "/v1/completions", {"model": "nope", "prompt": "x"}), 404)


def test_unknown_route_404(server):
    assert_error(post(server, "/v1/nothing", {}), 404)


def test_api_key(server):
    for key in (None, "wrong"):
        err = assert_error(post(server, "/v1/chat/completions", chat_body(), key=key), 401)
        assert err["code"] == "invalid_api_key"
        r = httpx.get(f"{server.base_url}/v1/models",
                      headers={"Authorization": f"Bearer {key}"} if key else {})
        assert_error(r, 401)
    # 401 comes before body parsing: a malformed body without a key is still 401
    assert_error(post(server, "/v1/chat/completions", content=b"{", key=None), 401)
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    # every route but /health needs the key (/metrics too, unless --public-metrics)
    for path in ("/metrics", "/debug/kv", "/docs", "/openapi.json"):
        assert_error(httpx.get(f"{server.base_url}{path}"), 401)
    assert_error(post(server, "/tokenize", {"prompt": "hi"}, key=None), 401)
    assert_error(post(server, "/detokenize", {"tokens": [1]}, key=None), 401)
    assert httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}
                     ).status_code == 200
    # the scheme is case-insensitive (RFC 7235)
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, (scheme, r.text)
    ok = post(server, "/v1/chat/completions", chat_body())
    assert ok.status_code == 200, ok.text
    client = server.openai()
    assert client.models.list().data[0].id == MODEL


def test_openai_client_raises_typed_errors(server):
    import openai
    client = server.openai()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=[{"role": "user",
                                                                   "content": "x"}])
    bad = server.openai()
    bad.api_key = "wrong"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.slow
def test_schemathesis_fuzz_no_5xx():
    """Property-based requests from /openapi.json: whatever the input, never a 5xx."""
    schemathesis = pytest.importorskip("schemathesis")

    fuzz = ServerProcess(default_model_args(64), api_key=KEY)  # short context: short outputs
    try:
        schema = schemathesis.openapi.from_url(f"{fuzz.base_url}/openapi.json",
                                               headers={"Authorization": f"Bearer {KEY}"})
        failures: list = []
        for result in schema.get_all_operations():
            _fuzz_operation(result.ok(), fuzz.base_url, failures)
        assert not failures, failures[:5]
        assert httpx.get(f"{fuzz.base_url}/health").status_code == 200
    finally:
        assert fuzz.stop() == 0, fuzz.log()


def _fuzz_operation(operation, base_url: str, failures: list) -> None:
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def check(case):
        response = case.call(base_url=base_url, timeout=120,
                             headers={"Authorization": f"Bearer {KEY}"})
        if response.status_code >= 500:
            failures.append((operation.label, case.body, response.status_code,
                             response.text[:300]))

    check()


def test_zz_sigterm_finishes_running_request_and_exits_0(server):
    """Runs last in this module: it stops the module's server."""
    result: dict = {}

    def run() -> None:
        body = chat_body(max_tokens=20, stream=False)
        body["messages"][0]["content"] = "Tell me about the sea."
        result["response"] = post(server, "/v1/chat/completions", body)

    t = threading.Thread(target=run)
    t.start()
    import time
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.metric("specserve:num_requests_running") < 1:
        time.sleep(0.05)
    rc = server.stop(signal.SIGTERM, timeout=60)
    t.join(60)
    assert rc == 0, server.log()
    r = result["response"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
