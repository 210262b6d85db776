"""POST /v1/chat/completions: chat template -> engine requests -> a body or an SSE stream.

Streaming sends, per choice, one role chunk, then text deltas of the engine's cumulative text
(which only grows and already holds back partial stop strings and incomplete UTF-8), then one
chunk with the finish_reason; then the usage chunk when asked, then [DONE].

Tool calling (docs/server.md, "Tool calling"): with `tools` and a tool_choice other than "none",
the tools reach the prompt (through the chat template when it renders tools, else as a system
message in the --tool-call-parser's format) and the output is parsed into `tool_calls`;
"required" or a named function also constrains the output with the parser's grammar. A streamed
choice sends content while its text cannot yet be the start of a call, holds the rest back, and
sends the calls as tool-call deltas when it finishes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, AsyncIterator

from specserve.request import RequestOutput, TokenLogprob
from specserve.server.async_engine import RequestStream
from specserve.server.openai_serving import (ServingContext, bad_request, choice_deltas,
                                             collect_finals, fan_out, from_value_error,
                                             make_usage, sampling_params, sse, sse_with_epilogue,
                                             submit)
from specserve.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest,
                                       ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                       ChatTokenLogprob, FunctionCall, ToolCall, TopLogprob, now,
                                       random_id)
from specserve.server.tool_parsers import ParsedCall, ToolParser, get_tool_parser, new_call_id
from specserve.structured import StructuredOutput


def tool_parser(ctx: ServingContext) -> ToolParser:
    """The server's tool-call parser (--tool-call-parser; default smollm)."""
    return getattr(ctx, "tool_parser", None) or get_tool_parser(None)


def template_renders_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def _arguments_value(arguments: str) -> Any:
    """Templates that render tool calls expect the arguments as a mapping."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _conversation(ctx: ServingContext, messages: list[ChatMessage],
                  tools: list[dict[str, Any]] | None, native: bool) -> list[dict[str, Any]]:
    """Messages as the chat template takes them. A template that renders tools gets tool calls
    and tool turns as they are; for any other, earlier calls become text in the parser's format
    and tool results become user turns of `<tool_response>` blocks (consecutive results share
    one turn, so templates that insist on alternating roles accept them), and the tools go
    into the first system message."""
    parser = tool_parser(ctx)
    conversation: list[dict[str, Any]] = []
    previous_was_tool = False
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        text = m.text()
        if native:
            entry: dict[str, Any] = {"role": role, "content": text}
            if m.tool_calls:
                entry["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name,
                                  "arguments": _arguments_value(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            conversation.append(entry)
            continue
        if m.tool_calls:
            calls = parser.format_calls([(c.function.name, c.function.arguments)
                                         for c in m.tool_calls])
            text = f"{text}\n{calls}" if text else calls
        if role == "tool":
            result = f"<tool_response>\n{text}\n</tool_response>"
            if previous_was_tool:
                conversation[-1]["content"] += "\n" + result
            else:
                conversation.append({"role": "user", "content": result})
            previous_was_tool = True
            continue
        previous_was_tool = False
        conversation.append({"role": role, "content": text})
    if tools and not native:
        described = parser.system_prompt(tools)
        if conversation and conversation[0]["role"] == "system":
            first = conversation[0]["content"]
            conversation[0]["content"] = f"{first}\n\n{described}" if first else described
        else:
            conversation.insert(0, {"role": "system", "content": described})
    return conversation


def render_chat_prompt(ctx: ServingContext, messages: list[ChatMessage],
                       tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text; `tools` (OpenAI function objects) are described to the model."""
    tokenizer = ctx.tokenizer
    native = template_renders_tools(tokenizer)
    conversation = _conversation(ctx, messages, tools, native)
    if getattr(tokenizer, "chat_template", None):
        kwargs: dict[str, Any] = {}
        if native and tools:
            kwargs["tools"] = [{"type": "function", "function": t} for t in tools]
        try:
            return tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - template errors (e.g. role order) are the user's
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
    # Tokenizers without a template (tiny test models): a plain transcript.
    lines = [f"{m['role']}: {m['content']}" for m in conversation]
    return "\n".join(lines) + "\nassistant:"


def _logprob_entries(ctx: ServingContext, items: list[TokenLogprob]) -> list[ChatTokenLogprob]:
    assert ctx.token_text is not None
    out = []
    for lp in items:
        text, raw = ctx.token_text(lp.token_id)
        top = []
        for token_id, logprob in lp.top:
            t, b = ctx.token_text(token_id)
            top.append(TopLogprob(token=t, logprob=logprob, bytes=b))
        out.append(ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=raw, top_logprobs=top))
    return out


def _tool_calls(parsed: list[ParsedCall]) -> list[ToolCall]:
    return [ToolCall(id=new_call_id(), function=FunctionCall(name=p.name, arguments=p.arguments))
            for p in parsed]


class _ToolCallStream:
    """One streamed choice under tool parsing: content while the text cannot yet be the start
    of a call (trailing whitespace held back too, as parse() drops it before a call), the calls
    once the output is finished. The streamed content always equals the non-streamed one."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent = 0  # characters of content sent
        self.call_started = False

    def content_delta(self, text: str) -> str:
        if self.call_started:
            return ""
        safe, start = self.parser.split(text)
        if start is not None:
            self.call_started = True
            safe = start
        return self._advance(text, len(text[:safe].rstrip()))

    def finish(self, text: str) -> tuple[str, list[ParsedCall]]:
        content, calls = self.parser.parse(text)
        if not calls:
            return self._advance(text, len(text)), []
        content = content or ""
        return self._advance(content, len(content)), calls

    def _advance(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent:end], end
        return piece


class ChatCall:
    """One validated chat request, submitted to the engine."""

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, tenant: str | None = None) -> None:
        self.ctx, self.req, self.tenant = ctx, req, tenant
        self.request_id = random_id("chatcmpl")
        self.created = now()
        self.model = req.model or ctx.served_model_name
        self.want_logprobs = req.logprobs
        self.stream: RequestStream | None = None
        self.num_prompt_tokens = 0
        self.index_of: dict[str, int] = {}
        self.parser: ToolParser | None = None  # set when the output is parsed for tool calls

    def _tools(self) -> tuple[list[dict[str, Any]] | None, str | None]:
        """(tools to describe to the model, the grammar that forces a call or None). With
        tool_choice "none" the tools are left out of the prompt and the output is not parsed:
        the model should not call them, and unrendered tools it cannot."""
        req = self.req
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice requires tools", "tool_choice")
            return None, None
        functions = [t.function.model_dump(exclude_none=True) for t in req.tools]
        names = [f["name"] for f in functions]
        for name in names:
            if names.count(name) > 1:
                raise bad_request(f"tools: the function name {name!r} appears more than once",
                                  "tools")
        if choice == "none":
            return None, None
        self.parser = tool_parser(self.ctx)
        if choice is None or choice == "auto":
            return functions, None
        name = None if choice == "required" else choice.function.name
        if name is not None and name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools",
                              "tool_choice")
        try:
            grammar = self.parser.grammar(functions, name, req.parallel_tool_calls is not False)
        except ValueError as e:
            raise from_value_error(e) from None
        return functions, grammar

    async def start(self) -> None:
        ctx, req = self.ctx, self.req
        ctx.check_model(req.model)
        ctx.admit(req.n)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        ctx.check_prompt_text(sum(len(m.text()) for m in req.messages), "messages")
        requests = await ctx.run_blocking(self._prepare)
        self.stream = await submit(ctx, requests, self.tenant)

    def _prepare(self) -> list:
        """The engine requests of the call (on the preprocessing thread: the chat template and
        the tokenizer run here)."""
        ctx, req = self.ctx, self.req
        tools, grammar = self._tools()
        prompt = render_chat_prompt(ctx, req.messages, tools)
        ctx.check_prompt_text(len(prompt), "messages")
        prompt_ids = ctx.tokenizer.encode(prompt, add_special_tokens=False)
        ctx.check_prompt_ids(prompt_ids, "messages")
        self.num_prompt_tokens = len(prompt_ids)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = ctx.resolve_max_tokens(requested, len(prompt_ids), param)
        params = sampling_params(req, max_tokens,
                                 (req.top_logprobs or 0) if req.logprobs else None)
        if grammar is not None:
            if params.structured is not None:
                raise bad_request(f"tool_choice {_choice_text(req)} forces a tool call, which "
                                  f"cannot be combined with {params.structured.param}",
                                  "tool_choice")
            params = dataclasses.replace(
                params, structured=StructuredOutput(grammar=grammar, param="tool_choice"))
        ctx.validate(prompt_ids, params)
        requests = fan_out(self.request_id, prompt_ids, params, req.n, prompt)
        self.index_of = {r[0]: i for i, r in enumerate(requests)}
        return requests

    async def collect(self) -> dict[str, Any]:
        assert self.stream is not None
        finals = await collect_finals(self.stream, self.index_of)
        choices = []
        for i, final in finals:
            c = final.outputs[0]
            logprobs = None
            if self.want_logprobs:
                logprobs = ChatLogprobs(content=_logprob_entries(self.ctx, c.logprobs or []))
            message, finish_reason = AssistantMessage(content=c.text), c.finish_reason
            if self.parser is not None:
                content, parsed = self.parser.parse(c.text)
                if parsed:
                    message = AssistantMessage(content=content, tool_calls=_tool_calls(parsed))
                    finish_reason = "tool_calls"
            choices.append(ChatChoice(index=i, message=message, finish_reason=finish_reason,
                                      logprobs=logprobs))
        usage = make_usage(self.num_prompt_tokens, [f for _, f in finals])
        body = ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                      choices=choices, usage=usage)
        return body.model_dump()

    async def stream_sse(self) -> AsyncIterator[str]:
        assert self.stream is not None
        req, n = self.req, len(self.index_of)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        header = {"id": self.request_id, "object": "chat.completion.chunk",
                  "created": self.created, "model": self.model}

        def chunk(choices: list[dict[str, Any]]) -> str:
            body: dict[str, Any] = {**header, "choices": choices}
            if include_usage:
                body["usage"] = None
            return sse(body)

        finals: list[RequestOutput] = []
        parser = self.parser
        tool_streams = [_ToolCallStream(parser) for _ in range(n)] if parser else []

        def tool_events(i: int, out: RequestOutput, logprobs: Any) -> list[str]:
            """A tool-parsed choice's chunks for one engine output: held-back content, and at
            the end each call (named first, then its arguments) and the finish_reason."""
            ts, c = tool_streams[i], out.outputs[0]
            if not out.finished:
                piece = ts.content_delta(c.text)
                if not piece and logprobs is None:
                    return []
                return [chunk([{"index": i, "delta": {"content": piece} if piece else {},
                                "logprobs": logprobs, "finish_reason": None}])]
            piece, calls = ts.finish(c.text)
            events = []
            if piece or logprobs is not None:
                events.append(chunk([{"index": i, "delta": {"content": piece} if piece else {},
                                      "logprobs": logprobs, "finish_reason": None}]))
            for k, call in enumerate(_tool_calls(calls)):
                first = {"index": k, "id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": ""}}
                rest = {"index": k, "function": {"arguments": call.function.arguments}}
                for part in (first, rest):
                    events.append(chunk([{"index": i, "delta": {"tool_calls": [part]},
                                          "logprobs": None, "finish_reason": None}]))
            events.append(chunk([{"index": i, "delta": {}, "logprobs": None,
                                  "finish_reason": "tool_calls" if calls else c.finish_reason}]))
            return events

        async def events() -> AsyncIterator[str]:
            for i in range(n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            async for i, out, delta, new_lps in choice_deltas(self.stream, self.index_of,
                                                              self.want_logprobs):
                logprobs = None
                if self.want_logprobs:
                    entries = _logprob_entries(self.ctx, new_lps)
                    logprobs = {"content": [e.model_dump() for e in entries]}
                if parser is not None:
                    for event in tool_events(i, out, logprobs):
                        yield event
                else:
                    yield chunk([{"index": i, "delta": {"content": delta} if delta else {},
                                  "logprobs": logprobs,
                                  "finish_reason": out.outputs[0].finish_reason if out.finished else None}])
                if out.finished:
                    finals.append(out)

        usage = (lambda: make_usage(self.num_prompt_tokens, finals)) if include_usage else None
        async for event in sse_with_epilogue(events(), self.stream, "chat", header, usage):
            yield event


def _choice_text(req: ChatCompletionRequest) -> str:
    choice = req.tool_choice
    return json.dumps(choice if isinstance(choice, str) else choice.model_dump())
