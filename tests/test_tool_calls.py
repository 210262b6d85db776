"""Tool calling: the three parsers (prompt text, grammar, parsing, streaming split), prompt
rendering, request validation, and end to end through the official `openai` client against real
servers on the default model (speculation "auto" and EAGLE)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import llguidance
import llguidance.hf
import openai
import pytest

from specserve.server.openai_serving import APIError
from specserve.server.protocol import ChatCompletionRequest, ChatMessage
from specserve.server.serving_chat import ChatCall, _ToolCallStream, render_chat_prompt
from specserve.server.tool_parsers import (TOOL_PARSERS, ParsedCall, arguments_schema,
                                           get_tool_parser)
from tests.server_fixtures import default_model_args, start_servers

MODEL = "smollm2-135m-instruct"
PARSERS = list(TOOL_PARSERS)

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 40},
                                         "unit": {"type": "string",
                                                  "enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"]}}
ADD = {"name": "add", "description": "Add two integers",
       "parameters": {"type": "object",
                      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}
NOW = {"name": "now", "description": "The current time"}  # no parameters: no arguments
FUNCTIONS = [WEATHER, ADD, NOW]
TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS]
BY_NAME = {f["name"]: f for f in FUNCTIONS}
_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
          "object": dict, "array": list}


def check_call(name: str, arguments: str) -> dict:
    """The arguments of a call to one of FUNCTIONS parse as JSON and follow its schema."""
    assert name in BY_NAME, name
    args = json.loads(arguments)
    schema = arguments_schema(BY_NAME[name])
    assert isinstance(args, dict)
    assert set(schema.get("required", [])) <= set(args) <= set(schema.get("properties", {}))
    for key, value in args.items():
        spec = schema["properties"][key]
        assert isinstance(value, _TYPES[spec["type"]]) and not (
            spec["type"] == "integer" and isinstance(value, bool)), (key, value)
        if "enum" in spec:
            assert value in spec["enum"]
        if "maxLength" in spec:
            assert len(value) <= spec["maxLength"]
    return args


# -- parsers -----------------------------------------------------------------------------------

CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", '{"a": 1, "b": 2}'),
         ("now", {})]
EXPECTED = [ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}'),
            ParsedCall("add", '{"a": 1, "b": 2}'), ParsedCall("now", "{}")]


@pytest.mark.parametrize("name", PARSERS)
def test_format_then_parse_round_trips(name):
    parser = get_tool_parser(name)
    assert parser.parse(parser.format_calls(CALLS)) == (None, EXPECTED)
    assert parser.parse(parser.format_calls(CALLS[:1])) == (None, EXPECTED[:1])


@pytest.mark.parametrize("name", PARSERS)
def test_plain_text_is_content(name):
    parser = get_tool_parser(name)
    for text in ["Paris is sunny today.", "", "  \n", "Use <tool_call> tags? No."]:
        assert parser.parse(text) == (text, [])


def test_smollm_parse():
    p = get_tool_parser("smollm")
    text = 'Let me check.\n<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>'
    assert p.parse(text) == ("Let me check.", [EXPECTED[1]])
    # one object without the list, arguments as a JSON string, a missing closing tag
    assert p.parse('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}') \
        == (None, [EXPECTED[1]])
    for bad in ['<tool_call>[{"name": "add", "arguments": {"a": 1</tool_call>',
                '<tool_call>[{"arguments": {}}]</tool_call>',
                '<tool_call>[{"name": "add", "arguments": [1, 2]}]</tool_call>',
                "<tool_call>[]</tool_call>"]:
        assert p.parse(bad) == (bad, []), bad


def test_hermes_parse():
    p = get_tool_parser("hermes")
    text = ('I will call two tools.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert p.parse(text) == ("I will call two tools.", EXPECTED[:2])
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>'
    assert p.parse(bad) == (bad, [])


def test_llama3_json_parse():
    p = get_tool_parser("llama3_json")
    assert p.parse('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}') \
        == (None, [EXPECTED[1]])
    assert p.parse(' {"name": "now", "parameters": {}};{"name": "add", "arguments": '
                   '{"a": 1, "b": 2}} ') == (None, [EXPECTED[2], EXPECTED[1]])
    for text in ['The answer is {"name": "add"}', '{"name": "add", "parameters": {}} trailing',
                 '{"a": 1}', '{"name": "add", "parameters": {"a": 1']:
        assert p.parse(text) == (text, []), text


@pytest.mark.parametrize("name", PARSERS)
@pytest.mark.parametrize("content", ["", "Sure, let me look that up. ", "a<b <tool ok\n"])
def test_streaming_split_matches_parse(name, content):
    """Fed one character at a time, the streamed content and the calls equal parse()'s, and no
    piece of a call marker is ever sent as content."""
    parser = get_tool_parser(name)
    if name == "llama3_json" and content:
        text, want = content + "no call here", (content + "no call here", [])
    else:
        text = content + parser.format_calls(CALLS[:2])
        want = (content.rstrip() or None, EXPECTED[:2])
    for full in (text, content):
        stream, sent = _ToolCallStream(parser), ""
        for i in range(1, len(full) + 1):
            sent += stream.content_delta(full[:i])
            assert full.startswith(sent)
        piece, calls = stream.finish(full)
        sent += piece
        expected = want if full is text else parser.parse(full)
        assert (sent or None, calls) == (expected[0] or None, expected[1])
        assert "<tool_call>" not in sent


# -- grammars --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ll_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    return tok, llguidance.hf.from_tokenizer(tok, n_vocab=49152, eos_token=[2])


def accepts(ll_tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar admits exactly `text` followed by EOS."""
    tok, lt = ll_tokenizer
    m = llguidance.LLMatcher(lt, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    for t in tok.encode(text, add_special_tokens=False):
        if not m.consume_token(t):
            return False
    return m.is_accepting() and m.consume_token(2)


@pytest.mark.parametrize("name", PARSERS)
def test_grammars_validate(name):
    parser = get_tool_parser(name)
    for choice in (None, "get_weather", "now"):
        for parallel in (True, False):
            grammar = llguidance.LLMatcher.grammar_from_lark(
                parser.grammar(FUNCTIONS, choice, parallel))
            assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    with pytest.raises(ValueError, match="tool_choice"):
        parser.grammar(FUNCTIONS, "missing", True)


@pytest.mark.parametrize("name", PARSERS)
def test_grammar_admits_valid_calls_only(name, ll_tokenizer):
    parser = get_tool_parser(name)
    fmt = parser.format_calls
    required = parser.grammar(FUNCTIONS, None, True)
    assert accepts(ll_tokenizer, required, fmt(CALLS[:1]))
    assert accepts(ll_tokenizer, required, fmt(CALLS))  # parallel calls
    assert not accepts(ll_tokenizer, required, "It is sunny in Paris.")
    assert not accepts(ll_tokenizer, required, fmt([("add", {"a": 1.5, "b": 2})]))  # not integer
    assert not accepts(ll_tokenizer, required, fmt([("add", {"a": 1})]))  # missing b
    assert not accepts(ll_tokenizer, required, fmt([("add", {"a": 1, "b": 2, "c": 3})]))
    assert not accepts(ll_tokenizer, required, fmt([("get_weather", {"city": "Paris",
                                                                     "unit": "kelvin"})]))
    assert not accepts(ll_tokenizer, required, fmt([("delete_all", {})]))  # unknown tool
    assert not accepts(ll_tokenizer, required, fmt([("now", {"x": 1})]))  # no parameters
    single = parser.grammar(FUNCTIONS, None, False)
    assert accepts(ll_tokenizer, single, fmt(CALLS[1:2]))
    assert not accepts(ll_tokenizer, single, fmt(CALLS[:2]))
    named = parser.grammar(FUNCTIONS, "add", True)
    assert accepts(ll_tokenizer, named, fmt(CALLS[1:2]))
    assert not accepts(ll_tokenizer, named, fmt(CALLS[:1]))


def test_grammar_survives_awkward_schemas(ll_tokenizer):
    """$defs references, descriptions holding "::=" (taken for GBNF otherwise) and quotes."""
    fn = {"name": "f", "description": 'x ::= "y" }',
          "parameters": {"type": "object", "$defs": {"n": {"type": "integer"}},
                         "properties": {"v": {"$ref": "#/$defs/n", "description": "a ::= b"}},
                         "required": ["v"]}}
    parser = get_tool_parser("hermes")
    grammar = parser.grammar([fn], None, True)
    assert "::=" not in grammar
    assert accepts(ll_tokenizer, grammar, parser.format_calls([("f", {"v": 3})]))
    assert not accepts(ll_tokenizer, grammar, parser.format_calls([("f", {"v": "3"})]))


# -- rendering and validation ----------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm_ctx(ll_tokenizer):
    return SimpleNamespace(tokenizer=ll_tokenizer[0], tool_call_parser="smollm",
                           served_model_name=MODEL)


def messages(*items: dict) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in items]


def test_render_tools_in_system_message(smollm_ctx):
    history = messages(
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"})
    prompt = render_chat_prompt(smollm_ctx, history, FUNCTIONS)
    assert prompt.count("<|im_start|>system") == 1
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions")
    assert '"name": "get_weather"' in prompt and "<tools>[" in prompt
    assert ('<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}]</tool_call><|im_end|>') in prompt
    assert ("<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n"
            "sunny\n</tool_response><|im_end|>") in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    plain = render_chat_prompt(smollm_ctx, history[1:2])
    assert "<tools>" not in plain and "SmolLM" in plain  # no tools: the template's own system


def test_render_through_a_template_that_knows_tools():
    seen = {}

    class Tok:
        chat_template = "{% if tools %}...{% endif %}"

        def apply_chat_template(self, conversation, **kwargs):
            seen.update(conversation=conversation, **kwargs)
            return "prompt"

    ctx = SimpleNamespace(tokenizer=Tok(), tool_call_parser="hermes")
    history = messages(
        {"role": "user", "content": "Add 1 and 2"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"})
    assert render_chat_prompt(ctx, history, FUNCTIONS) == "prompt"
    assert seen["tools"] == TOOLS
    assert seen["conversation"][1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert seen["conversation"][2] == {"role": "tool", "content": "3", "tool_call_id": "call_1"}


def _call(smollm_ctx, **body) -> ChatCall:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return ChatCall(smollm_ctx, ChatCompletionRequest.model_validate(body))


def test_tool_choice_validation(smollm_ctx):
    def error(**body) -> APIError:
        with pytest.raises(APIError) as e:
            _call(smollm_ctx, **body)._tools()
        assert e.value.status == 400
        return e.value

    assert error(tool_choice="required").param == "tool_choice"
    named = {"type": "function", "function": {"name": "missing"}}
    err = error(tools=TOOLS, tool_choice=named)
    assert err.param == "tool_choice" and "missing" in err.message
    assert error(tools=TOOLS + TOOLS[:1]).param == "tools"
    assert _call(smollm_ctx, tool_choice="none")._tools() == (None, None)
    assert _call(smollm_ctx, tools=TOOLS, tool_choice="none")._tools() == (None, None)
    tools, grammar = _call(smollm_ctx, tools=TOOLS)._tools()  # auto
    assert tools == FUNCTIONS and grammar is None
    tools, grammar = _call(smollm_ctx, tools=TOOLS, tool_choice="required",
                           parallel_tool_calls=False)._tools()
    assert grammar == get_tool_parser("smollm").grammar(FUNCTIONS, None, False)


def test_request_model_fields():
    with pytest.raises(ValueError):  # an undeclared field is rejected, not dropped
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              "tools": [{"type": "function", "function": {
                                                  "name": "f", "bogus": 1}}]})
    with pytest.raises(ValueError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              "tool_choice": "sometimes"})


# -- end to end ------------------------------------------------------------------------------

SPEC_CONFIGS = {"auto": [], "none": ["--speculative-config", "none"]}  # the default against plain
_RESULTS: dict[str, dict[str, object]] = {}  # config -> test -> calls, compared across configs


@pytest.fixture(scope="module")
def servers():
    procs = start_servers(**{name: default_model_args(max_model_len=1024) + args
                             for name, args in SPEC_CONFIGS.items()})
    for name, proc in procs.items():
        proc.config = name
    yield procs
    for proc in procs.values():
        proc.stop()


@pytest.fixture(scope="module", params=list(SPEC_CONFIGS))
def server(request, servers):
    return servers[request.param]


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def ask(client, content: str, **kw):
    kw.setdefault("max_tokens", 96)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], tools=TOOLS, **kw)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, check_call(c.function.name, c.function.arguments))
            for c in message.tool_calls]


def test_required_returns_a_valid_call(client, server):
    r = ask(client, "What's the weather like in Paris? Use celsius.", tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
    _RESULTS.setdefault(server.config, {})["required"] = calls_of(choice.message)


def test_named_tool_single_call(client, server):
    r = ask(client, "What is 17 plus 25?", parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "add"}})
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(message.tool_calls) == 1 and message.tool_calls[0].function.name == "add"
    _RESULTS.setdefault(server.config, {})["named"] = calls_of(message)


def test_required_streamed_equals_non_streamed(client):
    """Deltas accumulated the way clients do (arguments pieces concatenated per index) give
    the same calls as the non-streamed reply."""
    content = "Weather in Tokyo in fahrenheit, please."
    reference = ask(client, content, tool_choice="required")
    calls: dict[int, dict] = {}
    finish, text = None, ""
    for chunk in ask(client, content, tool_choice="required", stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                if d.function is not None:
                    entry["name"] += d.function.name or ""
                    entry["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and text == ""
    got = [(c["name"], check_call(c["name"], c["arguments"])) for _, c in sorted(calls.items())]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert got == calls_of(reference.choices[0].message)


def test_stream_helper_of_the_openai_client(client):
    """client.chat.completions.stream (ChatCompletionStreamState) with strict tools parses
    the streamed arguments itself."""
    strict = [{"type": "function", "function": {**ADD, "strict": True}}]
    with client.chat.completions.stream(
            model=MODEL, messages=[{"role": "user", "content": "Add 2 and 3."}], tools=strict,
            tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=64,
            temperature=0) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "add"
    assert call.function.parsed_arguments == check_call("add", call.function.arguments)


# Unconstrained requests: one server is enough.
AUTO_ONLY = pytest.mark.parametrize("server", ["auto"], indirect=True)


@AUTO_ONLY
def test_auto_and_none(client):
    r = ask(client, "What is the weather in Rome? Use celsius.", tool_choice="auto",
            max_tokens=48)
    choice = r.choices[0]
    if choice.message.tool_calls:  # the 135M model rarely calls in auto mode
        assert choice.finish_reason == "tool_calls"
        calls_of(choice.message)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    r = ask(client, "Say hello.", tool_choice="none", max_tokens=16)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


@AUTO_ONLY
def test_auto_streamed_equals_non_streamed(client):
    content = "Add 4 and 5 with the add tool."
    reference = ask(client, content, max_tokens=48).choices[0]
    text, finish, names = "", None, []
    for chunk in ask(client, content, stream=True, max_tokens=48):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            names += [d.function.name for d in choice.delta.tool_calls or [] if d.id]
            finish = choice.finish_reason or finish
    assert text == (reference.message.content or "")
    assert names == [c.function.name for c in reference.message.tool_calls or []]
    assert finish == reference.finish_reason


@AUTO_ONLY
def test_conversation_with_tool_results(client):
    first = ask(client, "What is 17 plus 25?", tool_choice="required").choices[0].message
    history = [{"role": "user", "content": "What is 17 plus 25?"}, first]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "42"} for c in first.tool_calls]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                       tool_choice="none", max_tokens=16, temperature=0)
    assert r.choices[0].message.content is not None


@AUTO_ONLY
def test_bad_tool_choice_is_400(client):
    cases = [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
              "tool_choice"),
             ({"tool_choice": "required"}, "tool_choice"),
             ({"tools": TOOLS, "tool_choice": "required",
               "response_format": {"type": "json_object"}}, "tool_choice")]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **body)
        assert e.value.status_code == 400
        assert e.value.body["param"] == param, e.value.body


def test_calls_identical_across_speculation(server):
    """Greedy calls under the grammar are the same whichever speculation served them."""
    if len(_RESULTS) < 2 or any(len(r) < 2 for r in _RESULTS.values()):
        pytest.skip("needs both servers' results (runs after the second one)")
    first, second = _RESULTS.values()
    assert first == second
