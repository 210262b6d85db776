"""POST /v1/completions: one or many prompts (text or token ids) x n choices.

Choice index = prompt_index * n + i, as OpenAI numbers them. Logprobs follow the legacy
completions format (tokens, token_logprobs, top_logprobs, text_offset). With echo, the prompt
text is prepended and its tokens carry null logprobs: the engine does not score prompts.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from specserve.request import RequestOutput, TokenLogprob
from specserve.server.async_engine import RequestStream
from specserve.server.openai_serving import (ServingContext, bad_request, choice_deltas,
                                             collect_finals, fan_out,
                                             make_usage, sampling_params, sse, sse_with_epilogue,
                                             submit)
from specserve.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                       CompletionResponse, now, random_id)


def prompt_items(prompt: Any) -> list[Any]:
    """The request's prompt field -> its prompts (each a text or a list of token ids)."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    return items


def normalize_prompts(ctx: ServingContext, items: list[Any]) -> list[tuple[str, list[int]]]:
    """Prompts (prompt_items) -> [(prompt text, prompt token ids)] (the tokenizer runs here)."""
    result = []
    for item in items:
        if isinstance(item, str):
            ctx.check_prompt_text(len(item), "prompt")
            ids = ctx.tokenizer.encode(item, add_special_tokens=True)
            text = item
        else:
            ids = list(item)
            ctx.check_prompt_ids(ids, "prompt")
            text = ctx.tokenizer.decode(ids)
        ctx.check_prompt_ids(ids, "prompt")
        result.append((text, ids))
    return result


class _LogprobBuilder:
    """Accumulates one choice's completions-format logprobs."""

    def __init__(self, ctx: ServingContext, start_offset: int) -> None:
        self.ctx = ctx
        self.offset = start_offset

    def add_prompt(self, ids: list[int], out: CompletionLogprobs) -> None:
        assert self.ctx.token_text is not None
        for token_id in ids:
            text, _ = self.ctx.token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(self.offset)
            self.offset += len(text)

    def add(self, items: list[TokenLogprob], out: CompletionLogprobs) -> None:
        assert self.ctx.token_text is not None
        for lp in items:
            text, _ = self.ctx.token_text(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            top = {self.ctx.token_text(t)[0]: v for t, v in lp.top}
            out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(text)


class CompletionCall:
    def __init__(self, ctx: ServingContext, req: CompletionRequest, tenant: str | None = None) -> None:
        self.ctx, self.req, self.tenant = ctx, req, tenant
        self.request_id = random_id("cmpl")
        self.created = now()
        self.model = req.model or ctx.served_model_name
        self.stream: RequestStream | None = None
        self.prompts: list[tuple[str, list[int]]] = []
        self.index_of: dict[str, int] = {}

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids in self.prompts)

    async def start(self) -> None:
        ctx, req = self.ctx, self.req
        ctx.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix: unsupported parameter: this server does not implement "
                              "insertion (fill-in-the-middle)", "suffix")
        items = prompt_items(req.prompt)
        ctx.admit(len(items) * req.n)
        requests = await ctx.run_blocking(self._prepare, items)
        self.stream = await submit(ctx, requests, self.tenant)

    def _prepare(self, items: list[Any]) -> list:
        """The engine requests of the call (on the preprocessing thread)."""
        ctx, req = self.ctx, self.req
        self.prompts = normalize_prompts(ctx, items)
        requests = []
        for p, (text, ids) in enumerate(self.prompts):
            max_tokens = ctx.resolve_max_tokens(req.max_tokens, len(ids))
            params = sampling_params(req, max_tokens, req.logprobs)
            ctx.validate(ids, params)
            requests += fan_out(f"{self.request_id}-{p}", ids, params, req.n, text)
        self.index_of = {r[0]: i for i, r in enumerate(requests)}
        return requests

    def _prompt_of(self, index: int) -> tuple[str, list[int]]:
        return self.prompts[index // self.req.n]

    async def collect(self) -> dict[str, Any]:
        assert self.stream is not None
        finals = await collect_finals(self.stream, self.index_of)
        choices = []
        for i, final in finals:
            c = final.outputs[0]
            prompt_text, prompt_ids = self._prompt_of(i)
            text = prompt_text + c.text if self.req.echo else c.text
            logprobs = None
            if self.req.logprobs is not None:
                logprobs = CompletionLogprobs()
                builder = _LogprobBuilder(self.ctx, 0)
                if self.req.echo:
                    builder.add_prompt(prompt_ids, logprobs)
                builder.add(c.logprobs or [], logprobs)
            choices.append(CompletionChoice(index=i, text=text, finish_reason=c.finish_reason,
                                            logprobs=logprobs))
        usage = make_usage(self.num_prompt_tokens, [f for _, f in finals])
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=choices, usage=usage).model_dump()

    async def stream_sse(self) -> AsyncIterator[str]:
        assert self.stream is not None
        req, n = self.req, len(self.index_of)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        header = {"id": self.request_id, "object": "text_completion", "created": self.created,
                  "model": self.model}

        def chunk(index: int, text: str, logprobs: CompletionLogprobs | None,
                  finish_reason: str | None) -> str:
            body: dict[str, Any] = {
                **header,
                "choices": [{"index": index, "text": text, "finish_reason": finish_reason,
                             "logprobs": logprobs.model_dump() if logprobs else None}]}
            if include_usage:
                body["usage"] = None
            return sse(body)

        builders = [_LogprobBuilder(self.ctx, 0) for _ in range(n)]
        finals: list[RequestOutput] = []

        async def events() -> AsyncIterator[str]:
            if req.echo:
                for i in range(n):
                    prompt_text, prompt_ids = self._prompt_of(i)
                    lps = None
                    if req.logprobs is not None:
                        lps = CompletionLogprobs()
                        builders[i].add_prompt(prompt_ids, lps)
                    yield chunk(i, prompt_text, lps, None)
            async for i, out, delta, new_lps in choice_deltas(self.stream, self.index_of,
                                                              req.logprobs is not None):
                lps = None
                if req.logprobs is not None:
                    lps = CompletionLogprobs()
                    builders[i].add(new_lps, lps)
                yield chunk(i, delta, lps, out.outputs[0].finish_reason if out.finished else None)
                if out.finished:
                    finals.append(out)

        usage = (lambda: make_usage(self.num_prompt_tokens, finals)) if include_usage else None
        async for event in sse_with_epilogue(events(), self.stream, "completion", header, usage):
            yield event
