"""Tool calling formats: how a model is told about tools, the grammar that forces a call, and how
calls are read back out of the model's text.

A parser (chosen with `specserve serve --tool-call-parser`) knows one text format:

- `smollm` (the default model's): `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`,
  one JSON list holding every call;
- `hermes` (Hermes 2 Pro, Qwen 2.5 and 3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call, blocks separated by a newline;
- `llama3_json` (Llama 3.1 to 3.3): `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several calls separated by `; `.

Each parser gives (a) the system-prompt text that lists the tools and the format, for chat
templates that do not render tools themselves, (b) the text of calls already made, for earlier
assistant turns, (c) the Lark grammar (llguidance's dialect, arguments as inline `%json` schemas)
that `tool_choice` "required" or a named function enforces, and (d) `parse` for a finished output
and `split` for streaming, which tells how much of a partial output is surely plain content.

The grammar's JSON uses the separators `", "` and `": "` (what the prompt shows and what
`json.dumps` writes), so a forced call looks like what the model would write unforced.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

DEFAULT_TOOL_PARSER = "smollm"

# Compact JSON, no whitespace choices: a small model under a flexible-whitespace grammar can
# emit newlines forever. These separators are what json.dumps writes by default.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ParsedCall:
    """One tool call read from model output; `arguments` is JSON text (an object)."""

    name: str
    arguments: str


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _json_literal(text: str) -> str:
    """A Lark string literal (JSON string escapes are Lark's)."""
    return json.dumps(text)


def _dumps(obj: Any) -> str:
    """JSON text safe inside a Lark grammar: StructuredOutput treats any text containing "::="
    as GBNF, and in JSON text "::=" can only occur inside strings, where "\\u003a" is the same."""
    return json.dumps(obj, ensure_ascii=False).replace("::=", "\\u003a\\u003a=")


def arguments_schema(fn: dict[str, Any]) -> dict[str, Any]:
    """The schema a forced call's arguments follow: the tool's `parameters` (no parameters means
    no arguments, as in OpenAI's API), closed to undeclared top-level keys when it does not say
    otherwise. Closing it only narrows what may be generated (every output still validates
    against the original) and stops a small model from inventing keys until max_tokens."""
    params = copy.deepcopy(fn.get("parameters") or {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ValueError(f"tools: the parameters of {fn.get('name')!r} must be a JSON schema object")
    params.setdefault("type", "object")
    if "properties" in params and "additionalProperties" not in params \
            and "patternProperties" not in params:
        params["additionalProperties"] = False
    return params


def _call_schema(fn: dict[str, Any], args_key: str) -> dict[str, Any]:
    """A whole call object {"name": <const>, args_key: <arguments>} as one JSON schema. `$defs`
    move to the root, where the parameters' `#/$defs/...` references point once nested."""
    params = arguments_schema(fn)
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
        "x-guidance": _JSON_STYLE,
    }
    for key in ("$defs", "definitions"):
        if key in params:
            schema[key] = params.pop(key)
    return schema


def _parsed(obj: Any, args_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call object -> ParsedCall, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser(ABC):
    """One tool-call text format (an abstract base: each parser implements the five methods).
    Tools are OpenAI function objects: {"name", "description"?, "parameters"?}."""

    name = ""
    args_key = "arguments"

    @abstractmethod
    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """The system-prompt text that lists the tools and the call format."""

    @abstractmethod
    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        """The text of calls (name, arguments as a dict or JSON text) in an assistant turn."""

    @abstractmethod
    def grammar(self, tools: list[dict[str, Any]], choice: str | None, parallel: bool) -> str:
        """Lark text that admits only calls: of the function `choice`, or of any tool when it is
        None ("required"); exactly one call unless `parallel`."""

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished output. Text without a well-formed call is all content
        (no calls); with calls, content is the text before the first one (None if blank)."""

    @abstractmethod
    def split(self, text: str) -> tuple[int, int | None]:
        """Streaming: (length of the prefix that is surely content, where a call starts or None).
        Text that may still become the start of a call is held back."""

    # -- shared pieces -------------------------------------------------------------------------
    def _call_rules(self, tools: list[dict[str, Any]], choice: str | None) -> str:
        fns = [t for t in tools if choice is None or t["name"] == choice]
        if not fns:
            raise ValueError(f"tool_choice: no tool named {choice!r}")
        rules = [f"call: {' | '.join(f'fn_{i}' for i in range(len(fns)))}"]
        rules += [f"fn_{i}: %json {_dumps(_call_schema(fn, self.args_key))}"
                  for i, fn in enumerate(fns)]
        return "\n".join(rules)

    def _call_json(self, name: str, arguments: Any) -> str:
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # else kept as text: the history is the client's
                arguments = json.loads(arguments)
        return json.dumps({"name": name, self.args_key: arguments}, ensure_ascii=False)

    @staticmethod
    def _tool_list(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
                for t in tools]

    @classmethod
    def _tool_lines(cls, tools: list[dict[str, Any]], sep: str) -> str:
        """Each tool as an OpenAI-style {"type": "function", "function": ...} JSON line."""
        return sep.join(json.dumps({"type": "function", "function": t}, ensure_ascii=False)
                        for t in cls._tool_list(tools))


class _MarkerParser(ToolParser):
    """Formats whose calls sit in `<tool_call>...</tool_call>` blocks after optional content. A
    block may hold one call object or a list of them (either format's models write both)."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def split(self, text: str) -> tuple[int, int | None]:
        start = text.find(self.open_tag)
        if start >= 0:
            return start, start
        for k in range(min(len(self.open_tag) - 1, len(text)), 0, -1):
            if text.endswith(self.open_tag[:k]):
                return len(text) - k, None
        return len(text), None

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = text.find(self.open_tag)
        if start < 0:
            return text, []
        calls: list[ParsedCall] = []
        for body in self._block.findall(text, start):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                return text, []
            items = obj if isinstance(obj, list) else [obj]
            parsed = [_parsed(item, ("arguments", "parameters")) for item in items]
            if not parsed or None in parsed:
                return text, []
            calls += parsed  # type: ignore[arg-type]
        if not calls:
            return text, []
        return text[:start].rstrip() or None, calls


class SmolLMToolParser(_MarkerParser):
    """SmolLM2-Instruct's format: all calls as one JSON list in a single `<tool_call>` block."""

    name = "smollm"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            "You can call functions (tools) to answer. The available tools, as JSON:\n"
            f"<tools>{json.dumps(self._tool_list(tools), ensure_ascii=False)}</tools>\n\n"
            "To call tools, reply with nothing but a JSON list of calls, in this format:\n"
            '<tool_call>[{"name": "tool_name", "arguments": {"argument": "value"}}]</tool_call>\n'
            "Give each argument a value of the type its schema asks for. If no tool fits the "
            "question, answer in plain text instead.")

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        body = ", ".join(self._call_json(name, args) for name, args in calls)
        return f"{self.open_tag}[{body}]{self.close_tag}"

    def grammar(self, tools: list[dict[str, Any]], choice: str | None, parallel: bool) -> str:
        calls = 'call (", " call)*' if parallel else "call"
        return (f'start: {_json_literal(self.open_tag + "[")} {calls} '
                f'{_json_literal("]" + self.close_tag)}\n' + self._call_rules(tools, choice))


class HermesToolParser(_MarkerParser):
    """Hermes 2 Pro / Qwen 2.5 style: one `<tool_call>` block per call, each one JSON object."""

    name = "hermes"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = self._tool_lines(tools, "\n")
        return (
            "# Tools\n\nYou may call one or more functions to answer. The function signatures "
            f"are inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
            "For each call, reply with a JSON object holding the function name and arguments "
            "inside <tool_call></tool_call>:\n"
            '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n'
            "</tool_call>")

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(f"{self.open_tag}\n{self._call_json(name, args)}\n{self.close_tag}"
                         for name, args in calls)

    def grammar(self, tools: list[dict[str, Any]], choice: str | None, parallel: bool) -> str:
        start = 'start: block ("\\n" block)*' if parallel else "start: block"
        block = (f"block: {_json_literal(self.open_tag + chr(10))} call "
                 f"{_json_literal(chr(10) + self.close_tag)}")
        return f"{start}\n{block}\n" + self._call_rules(tools, choice)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+ JSON tool calling: the whole output is the calls, `{"name", "parameters"}`
    objects separated by `;`, optionally after `<|python_tag|>` (a special token, normally
    skipped by the detokenizer). Output that does not start with one is content."""

    name = "llama3_json"
    args_key = "parameters"
    python_tag = "<|python_tag|>"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = self._tool_lines(tools, "\n\n")
        return (
            "You have access to the functions below. To call one, reply with only a JSON object "
            'of the form {"name": function name, "parameters": an object of argument names and '
            "values}; separate several calls with \"; \". Do not use variables. If no function "
            f"fits, answer in plain text.\n\n{listed}")

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(self._call_json(name, args) for name, args in calls)

    def grammar(self, tools: list[dict[str, Any]], choice: str | None, parallel: bool) -> str:
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return f"{start}\n" + self._call_rules(tools, choice)

    def split(self, text: str) -> tuple[int, int | None]:
        body = text.lstrip()
        lead = len(text) - len(body)
        if not body:
            return 0, None
        if body.startswith("{") or body.startswith(self.python_tag):
            return lead, lead
        if self.python_tag.startswith(body):
            return 0, None
        return len(text), None

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(self.python_tag):
            body = body[len(self.python_tag):].lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = _parsed(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            rest = body[pos:].lstrip()
            if not rest:
                break
            if not rest.startswith(";"):
                return text, []
            pos = len(body) - len(rest[1:].lstrip())
        return None, calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (SmolLMToolParser, HermesToolParser, Llama3JsonToolParser)}


def get_tool_parser(name: str | None = None) -> ToolParser:
    try:
        return TOOL_PARSERS[name or DEFAULT_TOOL_PARSER]()
    except KeyError:
        raise ValueError(f"tool_call_parser: unknown parser {name!r} "
                         f"(one of {', '.join(TOOL_PARSERS)})") from None
