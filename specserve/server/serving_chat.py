"""POST /v1/chat/completions: chat template -> engine requests -> a body or an SSE stream.

Streaming sends, per choice, one role chunk, then text deltas of the engine's cumulative text
(which only grows and already holds back partial stop strings and incomplete UTF-8), then one
chunk with the finish_reason; then the usage chunk when asked, then [DONE].
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from specserve.request import RequestOutput, TokenLogprob
from specserve.server.async_engine import RequestStream
from specserve.server.openai_serving import (ServingContext, bad_request, choice_deltas,
                                             collect_finals, fan_out,
                                             make_usage, sampling_params, sse, sse_with_epilogue,
                                             submit)
from specserve.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest,
                                       ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                       ChatTokenLogprob, TopLogprob, now, random_id)


def render_chat_prompt(ctx: ServingContext, messages: list[ChatMessage]) -> str:
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in messages]
    tokenizer = ctx.tokenizer
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=True)
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


class ChatCall:
    """One validated chat request, submitted to the engine."""

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest) -> None:
        self.ctx, self.req = ctx, req
        self.request_id = random_id("chatcmpl")
        self.created = now()
        self.model = req.model or ctx.served_model_name
        self.want_logprobs = req.logprobs
        self.stream: RequestStream | None = None
        self.num_prompt_tokens = 0
        self.index_of: dict[str, int] = {}

    async def start(self) -> None:
        ctx, req = self.ctx, self.req
        ctx.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        prompt = render_chat_prompt(ctx, req.messages)
        prompt_ids = ctx.tokenizer.encode(prompt, add_special_tokens=False)
        ctx.check_prompt_ids(prompt_ids, "messages")
        self.num_prompt_tokens = len(prompt_ids)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = ctx.resolve_max_tokens(requested, len(prompt_ids), param)
        params = sampling_params(req, max_tokens,
                                 (req.top_logprobs or 0) if req.logprobs else None)
        requests = fan_out(self.request_id, prompt_ids, params, req.n, prompt)
        self.index_of = {r[0]: i for i, r in enumerate(requests)}
        self.stream = await submit(ctx, requests)

    async def collect(self) -> dict[str, Any]:
        assert self.stream is not None
        finals = await collect_finals(self.stream, self.index_of)
        choices = []
        for i, final in finals:
            c = final.outputs[0]
            logprobs = None
            if self.want_logprobs:
                logprobs = ChatLogprobs(content=_logprob_entries(self.ctx, c.logprobs or []))
            choices.append(ChatChoice(index=i, message=AssistantMessage(content=c.text),
                                      finish_reason=c.finish_reason, logprobs=logprobs))
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
                yield chunk([{"index": i, "delta": {"content": delta} if delta else {},
                              "logprobs": logprobs,
                              "finish_reason": out.outputs[0].finish_reason if out.finished else None}])
                if out.finished:
                    finals.append(out)

        usage = (lambda: make_usage(self.num_prompt_tokens, finals)) if include_usage else None
        async for event in sse_with_epilogue(events(), self.stream, "chat", header, usage):
            yield event
