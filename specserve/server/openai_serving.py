"""What the chat and completions endpoints share: errors, model names, sampling parameters,
fan-out of n choices into engine requests, token text for logprobs, usage, SSE framing.

Nothing here talks HTTP; the endpoints in serving_chat / serving_completions return bodies
or async iterators of SSE strings, and app.py turns them into responses.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from specserve.detokenizer import stop_matcher
from specserve.request import RequestOutput, SamplingParams
from specserve.structured import StructuredOutput
from specserve.server.async_engine import AsyncEngine, EngineError
from specserve.server.protocol import SpeculationUsage, Usage, _SamplingFields

logger = logging.getLogger("specserve.server")

GRAMMAR_TIMEOUT_S = 10.0  # a constraint that compiles longer is refused (400)


class APIError(Exception):
    """An error with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = \
            status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_value_error(e: ValueError) -> APIError:
    """SamplingParams and Engine raise ValueError("field: reason"): the field is the param."""
    text = str(e)
    head, sep, _ = text.partition(":")
    param = head.strip() if sep and head.strip().replace("_", "").isalnum() else None
    return bad_request(text, param)


# -- token text ------------------------------------------------------------------------------

def _byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable-character alphabet, inverted: char -> byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_TABLE = _byte_level_table()


class TokenText:
    """Display text and raw bytes of single tokens (cached), for logprobs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id])
            hit = (text, self._raw_bytes(token_id, text))
            self._cache[token_id] = hit
        return hit

    def _raw_bytes(self, token_id: int, text: str) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece:
            if all(c in _BYTE_TABLE for c in piece):
                return [_BYTE_TABLE[c] for c in piece]
            if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
                try:
                    return [int(piece[3:5], 16)]
                except ValueError:
                    pass
        return list(text.encode("utf-8"))


# -- the serving context ---------------------------------------------------------------------

@dataclass
class ServingContext:
    """Everything an endpoint needs; built once per app.

    Work that grows with a request's size (chat templating, tokenizing, detokenizing,
    compiling a grammar) runs on `run_blocking`'s worker threads, never on the event loop,
    and only after cheap size checks: a prompt of more characters than `max_prompt_chars`
    cannot fit the context (no token spans more characters than the vocabulary's longest), so
    it is refused before it is tokenized.
    """

    async_engine: AsyncEngine
    served_model_name: str
    aliases: list[str] = field(default_factory=list)
    max_model_len: int = 2048
    tokenizer: Any = None
    vocab_size: int = 0
    token_text: TokenText | None = None
    tool_parser: Any = None  # tool_parsers.ToolParser: the model's tool-call format
    max_request_tokens: int = 2048  # prompt and output of one request: the context or the KV cache
    max_prompt_chars: int = 1 << 62
    grammar_timeout: float = GRAMMAR_TIMEOUT_S
    # one thread: the tokenizer is not shared between threads (grammars have their own pool)
    _pre: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        1, thread_name_prefix="specserve-preprocess"))
    _grammar_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        2, thread_name_prefix="specserve-grammar"))

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the preprocessing thread (tokenizer work), awaited."""
        return await asyncio.get_running_loop().run_in_executor(self._pre, fn, *args)

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar (if any) on a grammar thread, so the engine thread
        finds it compiled; a grammar that takes longer than `grammar_timeout` is refused."""
        spec = params.structured
        if spec is None:
            return
        engine = self.async_engine.engine
        try:  # (compile checks the limits first: StructuredOutput.check)
            work = asyncio.get_running_loop().run_in_executor(
                self._grammar_pool, lambda: engine.grammars.compile(spec))
            await asyncio.wait_for(work, self.grammar_timeout)
        except ValueError as e:
            raise from_value_error(e) from None
        except asyncio.TimeoutError:
            raise bad_request(f"{spec.param}: the constraint took longer than "
                              f"{self.grammar_timeout:g} s to compile; simplify it", spec.param) from None

    def admit(self, n: int) -> None:
        """Before any work on a call of `n` sequences: refused if the server cannot take them
        (429 now, or 400 if never), or is shutting down (503)."""
        try:
            self.async_engine.check_admission(n)
        except ValueError as e:
            raise from_value_error(e) from None

    def shutdown(self) -> None:
        self._pre.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def create(async_engine: AsyncEngine, served_model_name: str,
               aliases: list[str] | None = None, tool_call_parser: str | None = None) -> "ServingContext":
        from specserve.server.tool_parsers import get_tool_parser

        engine = async_engine.engine
        # A private copy: the engine thread detokenizes with its own, and Rust tokenizers
        # do not like concurrent use of one object.
        try:
            tokenizer = copy.deepcopy(engine.tokenizer)
        except Exception:  # noqa: BLE001
            tokenizer = engine.tokenizer
        names = list(aliases or [])
        engine_names = [getattr(engine, "model_name", None)]
        engine_names += list(getattr(engine, "model_aliases", None) or [])
        for name in engine_names:
            if name and name != served_model_name and name not in names:
                names.append(name)
        vocab = getattr(engine, "vocab_size", None) or len(tokenizer)
        max_model_len = int(getattr(engine, "max_model_len", 2048))
        max_request_tokens = int(getattr(engine, "max_request_tokens", max_model_len))
        try:
            longest = max(len(piece) for piece in tokenizer.get_vocab())
            max_prompt_chars = max_request_tokens * max(longest, 1)
        except Exception:  # noqa: BLE001 - no vocabulary to read: no early check
            max_prompt_chars = 1 << 62
        return ServingContext(async_engine, served_model_name, names, max_model_len, tokenizer,
                              int(vocab), TokenText(tokenizer), get_tool_parser(tool_call_parser),
                              max_request_tokens, max_prompt_chars)

    def check_model(self, model: str | None) -> None:
        if model is None or model == self.served_model_name or model in self.aliases:
            return
        raise APIError(404, f"The model `{model}` does not exist.", "model",
                       code="model_not_found")

    def _too_long(self, num_tokens: int | None, param: str) -> APIError:
        prompt = f"{num_tokens} tokens" if num_tokens is not None else "more tokens than that"
        if self.max_request_tokens < self.max_model_len:
            return bad_request(f"This server's KV cache holds {self.max_request_tokens} tokens of "
                               f"one request. However, your prompt has {prompt}, which leaves no "
                               "room to generate.", param)
        return bad_request(f"This model's maximum context length is {self.max_model_len} tokens. "
                           f"However, your prompt has {prompt}, which leaves no room to generate.",
                           param)

    def check_prompt_text(self, num_chars: int, param: str) -> None:
        """Before tokenizing: a prompt this long cannot fit whatever it tokenizes to."""
        if num_chars > self.max_prompt_chars:
            raise self._too_long(None, param)

    def check_prompt_ids(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise bad_request("the prompt is empty", param)
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary "
                              f"[0, {self.vocab_size})", param)
        if len(token_ids) >= self.max_request_tokens:
            raise self._too_long(len(token_ids), param)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The engine's own checks of a request, here, before it reaches the engine thread
        (its grammar is compiled apart: `compile_grammar`), and its stop strings' automaton
        built."""
        validate = getattr(self.async_engine.engine, "validate", None)
        if validate is not None:
            try:
                validate(prompt_ids, params, compile_grammar=False)
            except ValueError as e:
                raise from_value_error(e) from None
        if params.stop:
            stop_matcher(params.stop)  # built here (cached), not on the engine thread

    def resolve_max_tokens(self, requested: int | None, num_prompt_tokens: int,
                           param: str = "max_tokens") -> int:
        """The request's max_tokens: as asked (a 400 if it cannot fit), or with none asked, as
        many as the context and the KV cache leave."""
        if requested is None:
            return self.max_request_tokens - num_prompt_tokens
        if num_prompt_tokens + requested > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in "
                f"the prompt, {requested} in the completion). Reduce the prompt or {param}.",
                param)
        if num_prompt_tokens + requested > self.max_request_tokens:
            raise bad_request(
                f"This server's KV cache holds {self.max_request_tokens} tokens of one request. "
                f"However, you requested {num_prompt_tokens + requested} tokens "
                f"({num_prompt_tokens} in the prompt, {requested} in the completion). Reduce "
                f"the prompt or {param}.", param)
        return requested


def sampling_params(req: _SamplingFields, max_tokens: int, logprobs: int | None
                    ) -> SamplingParams:
    try:
        return SamplingParams(
            n=1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty or 1.0,
            logprobs=logprobs,
            logit_bias=_logit_bias(req.logit_bias),
            min_tokens=req.min_tokens,
            structured=structured_output(req),
        )
    except ValueError as e:
        raise from_value_error(e) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(k): float(v) for k, v in bias.items()}
    except ValueError:
        raise ValueError("logit_bias: keys must be token ids (integers as strings)") from None


def structured_output(req: _SamplingFields) -> StructuredOutput | None:
    """The request's one output constraint: OpenAI's response_format, vLLM's
    structured_outputs, or vLLM's older guided_* fields (more than one is a 400)."""
    found: list[StructuredOutput] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(StructuredOutput(json='{"type": "object"}', param="response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ValueError("response_format: json_schema.schema is required for type json_schema")
        found.append(StructuredOutput(json=json.dumps(fmt.json_schema.schema_), param="response_format"))
    so = req.structured_outputs
    if so is not None:
        kinds = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
        if so.json_object:
            kinds["json"] = kinds["json"] or {"type": "object"}
        found += [_constraint(kind, value, "structured_outputs") for kind, value in kinds.items() if value is not None]
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append(_constraint(kind, value, f"guided_{kind}"))
    if len(found) > 1:
        raise ValueError(f"{found[1].param}: only one output constraint per request "
                         f"(also given: {found[0].param})")
    return found[0] if found else None


def _constraint(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput(json=value if isinstance(value, str) else json.dumps(value), param=param)
    if kind == "choice":
        return StructuredOutput(choice=tuple(value), param=param)
    return StructuredOutput(**{kind: value}, param=param)


def fan_out(base_id: str, prompt_ids: list[int], params: SamplingParams, n: int,
            prompt: str | None) -> list[tuple[str, list[int], SamplingParams, str | None]]:
    """n choices -> n engine requests "<id>-<i>"; seeded requests get seed + i."""
    out = []
    for i in range(n):
        p = params
        if params.seed is not None and i > 0:
            p = copy.copy(params)
            p.seed = params.seed + i
        out.append((f"{base_id}-{i}", prompt_ids, p, prompt))
    return out


async def submit(ctx: ServingContext, requests: list, tenant: str | None = None) -> Any:
    """Compile the call's grammar off the engine thread, then hand its requests to the engine
    (`tenant`: which API key it came with, app.APIKeyMiddleware)."""
    if requests:
        await ctx.compile_grammar(requests[0][2])
    try:
        return await ctx.async_engine.add_requests(requests, tenant)
    except ValueError as e:
        raise from_value_error(e) from None


def engine_error_body(e: BaseException, request_id: str) -> dict[str, Any]:
    """The error body a stream ends with: an EngineError as it is, anything else generic (the
    details go to the log, never to a client)."""
    if isinstance(e, EngineError):
        return APIError(e.status, str(e), type=e.type, code=e.code).body()
    return APIError(500, f"internal error while generating ({request_id}); the server log has "
                         "the details", type="internal_error").body()


def make_usage(num_prompt_tokens: int, finals: list[RequestOutput]) -> Usage:
    completion = sum(len(o.outputs[0].token_ids) for o in finals)
    spec = SpeculationUsage(num_draft_tokens=sum(o.num_draft_tokens for o in finals),
                            num_accepted_tokens=sum(o.num_accepted_tokens for o in finals))
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=completion,
                 total_tokens=num_prompt_tokens + completion, speculation=spec)


def sse(payload: dict[str, Any] | str) -> str:
    if isinstance(payload, str):
        return f"data: {payload}\n\n"
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


async def choice_deltas(stream: Any, index_of: dict[str, int], want_logprobs: bool
                        ) -> AsyncIterator[tuple[int, RequestOutput, str, list]]:
    """(choice index, output, new text, new logprobs) each time a choice moves or finishes.

    The engine's cumulative text only grows, so the delta is the suffix not sent yet; its
    logprobs are already those of the new tokens only.
    """
    sent_chars = [0] * len(index_of)
    async for out in stream:
        i = index_of[out.request_id]
        c = out.outputs[0]
        delta = c.text[sent_chars[i]:]
        new_lps = (c.logprobs or []) if want_logprobs else []
        if not delta and not new_lps and not out.finished:
            continue
        sent_chars[i] = len(c.text)
        yield i, out, delta, new_lps


async def sse_with_epilogue(events: AsyncIterator[str], stream: Any, what: str,
                            header: dict[str, Any],
                            usage: Callable[[], Usage] | None) -> AsyncIterator[str]:
    """Wrap a stream's chunks: the usage chunk (`header` fields, no choices) when `usage` is
    given, errors reported in-band (the status line is already sent), the engine stream closed
    (aborting what still runs), then `data: [DONE]`."""
    try:
        async for event in events:
            yield event
        if usage is not None:
            yield sse({**header, "choices": [], "usage": usage().model_dump()})
    except APIError as e:
        yield sse(e.body())
    except EngineError as e:
        yield sse(engine_error_body(e, header["id"]))
    except Exception as e:  # noqa: BLE001 - the status line is gone: report in-band
        logger.exception("%s stream %s failed", what, header["id"])
        yield sse(engine_error_body(e, header["id"]))
    finally:
        await stream.aclose()
    yield SSE_DONE


async def collect_finals(stream: Any, index_of: dict[str, int]) -> list[tuple[int, RequestOutput]]:
    """Drain a non-streaming call's engine stream: (choice index, final output with every
    logprob), in order."""
    finals: dict[int, RequestOutput] = {}
    logprobs: dict[int, list] = {}
    try:
        async for out in stream:
            i, c = index_of[out.request_id], out.outputs[0]
            if c.logprobs is not None:
                logprobs.setdefault(i, []).extend(c.logprobs)
                c.logprobs = logprobs[i]
            if out.finished:
                finals[i] = out
    finally:
        await stream.aclose()
    return sorted(finals.items())
