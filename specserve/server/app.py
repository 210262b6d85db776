"""The FastAPI app: routes, API-key check, OpenAI-style error bodies, SSE responses.

`build_app` wires an AsyncEngine (already holding a loaded Engine) to the routes; the app's
lifespan starts the engine thread and stops it on shutdown. Every error leaves as
{"error": {"message", "type", "param", "code"}}: 400 for bad input (pydantic's 422 included),
401 for a bad key, 404 for an unknown model or route, 408 past --request-timeout, 413 for a
body over the limit, 429 (with Retry-After) when the server is at capacity, 503 while the
engine is down or the server shuts down, and a catch-all 500 (details only in the log) that
keeps the connection open.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Any, AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from specserve.metrics import CONTENT_TYPE, ServerMetrics
from specserve.server.async_engine import AsyncEngine, EngineError
from specserve.server.openai_serving import APIError, ServingContext
from specserve.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                       DetokenizeRequest, ModelCard, ModelList, TokenizeRequest)
from specserve.server.serving_chat import ChatCall, render_chat_prompt
from specserve.server.serving_completions import CompletionCall

logger = logging.getLogger("specserve.server")


def error_response(status: int, message: str, param: str | None = None,
                   type: str = "invalid_request_error", code: Any = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, param, type, code).body(), status_code=status)


class APIKeyMiddleware:
    """Pure ASGI (so streaming and disconnect detection stay untouched): every route needs
    `Authorization: Bearer KEY` (the scheme in any case) with one of the keys, except /health,
    and /metrics when `public_metrics` is set. Each key is a tenant: the request's
    `state.tenant` names which ("key-<i>"), so that what one tenant's requests wrote is never
    drafted for another's (suffix decoding)."""

    def __init__(self, app: ASGIApp, api_keys: list[str], public_metrics: bool = False) -> None:
        self.app = app
        self.expected = [key.encode() for key in api_keys]
        self.open_paths = {"/health"} | ({"/metrics"} if public_metrics else set())

    def _tenant(self, scope: Scope) -> str | None:
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, key = given.strip().partition(b" ")
        found = None
        for i, expected in enumerate(self.expected):  # every key compared: no timing by position
            if hmac.compare_digest(key.strip(), expected) and found is None:
                found = f"key-{i}"
        return found if scheme.lower() == b"bearer" else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            tenant = self._tenant(scope)
            if tenant is None and scope["path"] not in self.open_paths:
                response = error_response(401, "Incorrect API key provided.", code="invalid_api_key")
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


class CatchAllMiddleware:
    """An exception no handler took becomes a 500 with an OpenAI error body and the
    connection stays open (Starlette's own last resort re-raises, and uvicorn then drops the
    keep-alive connection). Details go to the log, never to the client."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception:  # noqa: BLE001 - the last resort
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                response = error_response(500, "internal error; the server log has the details",
                                          type="internal_error")
                await response(scope, receive, send)


class BodyLimitMiddleware:
    """413 for request bodies over `max_bytes`: by Content-Length before anything is read, and
    while reading a body sent without one (chunked), so no body is ever held whole past it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = error_response(413, f"the request body exceeds {self.max_bytes} bytes "
                                        "(--max-request-body-bytes)", code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await too_large(scope, receive, send)
            return
        seen, rejected = 0, False

        async def counted() -> dict:
            nonlocal seen, rejected
            message = await receive()
            if message["type"] == "http.request" and not rejected:
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # answer now; the app sees the client gone
                    rejected = True
                    await too_large(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            if not rejected:  # after a 413, whatever the app answers goes nowhere
                await send(message)

        await self.app(scope, counted, guarded_send)


def _validation_param(errors: list[dict[str, Any]]) -> str | None:
    if not errors:
        return None
    loc = [str(p) for p in errors[0].get("loc", ()) if p != "body"]
    return ".".join(loc) or None


def _validation_message(errors: list[dict[str, Any]]) -> str:
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        msg = err.get("msg", "invalid")
        if err.get("type") == "value_error" and "error" in err.get("ctx", {}):
            msg = str(err["ctx"]["error"])  # our validators' own words, without "Value error, "
        if err.get("type") == "extra_forbidden":  # never silently dropped (docs/server.md)
            msg = "unsupported parameter: this server does not implement it"
        parts.append(f"{loc}: {msg}" if loc else str(msg))
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        if errors and errors[0].get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON")
        return error_response(400, _validation_message(errors), _validation_param(errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(exc.status_code, str(exc.detail), code=code)

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> JSONResponse:
        response = error_response(exc.status, str(exc), type=exc.type, code=exc.code)
        if exc.retry_after is not None:
            response.headers["Retry-After"] = str(max(1, round(exc.retry_after)))
        return response


async def _abort_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work` (a non-streaming request); if the client goes away first, cancel it,
    which closes its engine stream and so aborts its engine requests."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        return Response(status_code=499)
    return task.result()


class _SSEResponse(StreamingResponse):
    """Closes the call's engine stream however the response ends (even if never iterated)."""

    def __init__(self, call: ChatCall | CompletionCall) -> None:
        super().__init__(call.stream_sse(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._call.stream is not None:
                await self._call.stream.aclose()


DEFAULT_MAX_BODY_BYTES = 16 << 20
MAX_DETOKENIZE = 1 << 16  # tokens per /detokenize call (or the context length, if longer)


def build_app(async_engine: AsyncEngine, served_model_name: str,
              api_key: str | list[str] | None = None,
              aliases: list[str] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              tool_call_parser: str | None = None, public_metrics: bool = False) -> FastAPI:
    ctx = ServingContext.create(async_engine, served_model_name, aliases, tool_call_parser)
    if async_engine.metrics is None:
        async_engine.metrics = ServerMetrics(served_model_name)
    metrics: ServerMetrics = async_engine.metrics

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.stop)
            ctx.shutdown()

    app = FastAPI(title="specserve", version="0.1.0", lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_middleware(CatchAllMiddleware)
    keys = [api_key] if isinstance(api_key, str) else [k for k in api_key or [] if k]
    if keys:
        app.add_middleware(APIKeyMiddleware, api_keys=keys, public_metrics=public_metrics)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)  # outermost: before the key check

    @app.get("/health")
    async def health() -> Response:
        problem = async_engine.health()
        if problem is None:
            return JSONResponse({"status": "ok"})
        return error_response(503, problem, type="service_unavailable")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/debug/kv")
    async def debug_kv() -> Response:
        return JSONResponse(async_engine.kv_snapshot)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Any:
        ctx.check_model(body.model)
        param = "messages" if body.messages else "prompt"
        ctx.check_prompt_text(sum(len(m.text()) for m in body.messages) if body.messages
                              else len(body.prompt or ""), param)

        def encode() -> list[int]:
            if body.messages:
                text = render_chat_prompt(ctx, body.messages)
                ctx.check_prompt_text(len(text), param)
                return ctx.tokenizer.encode(text, add_special_tokens=False)
            return ctx.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)

        tokens = await ctx.run_blocking(encode)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Any:
        ctx.check_model(body.model)
        if len(body.tokens) > max(ctx.max_model_len, MAX_DETOKENIZE):
            raise APIError(400, f"at most {max(ctx.max_model_len, MAX_DETOKENIZE)} tokens per "
                                "call", "tokens")
        bad = [t for t in body.tokens if not 0 <= t < ctx.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary", "tokens")
        return {"prompt": await ctx.run_blocking(ctx.tokenizer.decode, body.tokens)}

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> Any:
        cards = [ModelCard(id=name, root=served_model_name, max_model_len=ctx.max_model_len)
                 for name in [served_model_name] + ctx.aliases]
        return ModelList(data=cards)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        call = ChatCall(ctx, body, getattr(request.state, "tenant", None))
        await call.start()
        if body.stream:
            return _SSEResponse(call)
        return await _abort_on_disconnect(request, call.collect())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        call = CompletionCall(ctx, body, getattr(request.state, "tenant", None))
        await call.start()
        if body.stream:
            return _SSEResponse(call)
        return await _abort_on_disconnect(request, call.collect())

    return app
