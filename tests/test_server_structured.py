"""Structured output over HTTP with the official `openai` client, on a plain server and an EAGLE
one: response_format json_schema (strict) and json_object, vLLM's structured_outputs and
guided_* fields, logit_bias; greedy replies identical on both; unsupported fields and bad
constraints are 400s naming the field; oversized bodies are 413s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server_fixtures import default_model_args, start_servers

MODEL = "smollm2-135m-instruct"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
          "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}}


@pytest.fixture(scope="module")
def servers():
    procs = start_servers(plain=default_model_args() + ["--speculative-config", "none",
                                                        "--max-request-body-bytes", "100000"],
                          eagle=default_model_args() + ["--speculative-config", '{"method": "eagle"}'])
    yield procs
    for proc in procs.values():
        proc.stop()


def ask(proc, content: str, **kw):
    kw.setdefault("max_tokens", 48)
    return proc.openai().chat.completions.create(
        model=MODEL, temperature=0, messages=[{"role": "user", "content": content}], **kw)


def both(servers, content: str, **kw) -> str:
    """The reply of the plain and the EAGLE server, which must be identical."""
    plain, spec = (ask(servers[k], content, **kw).choices[0] for k in ("plain", "eagle"))
    assert spec.message.content == plain.message.content
    return plain.message.content


def test_json_schema_and_json_object(servers):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    text = both(servers, "Name a large city and its population.", response_format=fmt)
    jsonschema.validate(json.loads(text), SCHEMA)
    obj = both(servers, "Give me a JSON object with a name and an age.", response_format={"type": "json_object"},
               max_tokens=64)  # a complete object in float32 and in bfloat16
    assert isinstance(json.loads(obj), dict)
    streamed = ask(servers["eagle"], "Name a large city and its population.", response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text


def test_vllm_fields_and_logit_bias(servers):
    assert both(servers, "Is water wet?", extra_body={"guided_choice": ["yes", "no"]}) in ("yes", "no")
    code = both(servers, "Give a code.", extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{3}"}})
    assert len(code) == 7 and code[3] == "-"
    token = httpx.post(f"{servers['plain'].base_url}/tokenize",
                       json={"prompt": " banana", "add_special_tokens": False}).json()["tokens"][0]
    forced = both(servers, "Say hi.", logit_bias={str(token): 100}, max_tokens=5)
    assert forced == " banana" * 5


@pytest.mark.parametrize("kw, param", [
    ({"extra_body": {"functions_v2": []}}, "functions_v2"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
])
def test_what_is_not_served_is_a_400_naming_it(servers, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        ask(servers["plain"], "hi", **kw)
    assert e.value.body["param"] == param, e.value.body
    assert ask(servers["plain"], "hi", max_tokens=2).choices[0].message.content  # still serving


def test_oversized_bodies_are_413(servers):
    url = f"{servers['plain'].base_url}/v1/chat/completions"
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 200_000}]}
    assert httpx.post(url, json=big, timeout=30).status_code == 413

    def chunks():  # no Content-Length: counted while read
        yield b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "'
        for _ in range(30):
            yield b"y" * 10_000
        yield b'"}]}'

    r = httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
