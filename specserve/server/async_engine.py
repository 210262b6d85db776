"""AsyncEngine: the bridge between the asyncio server and the (synchronous) Engine.

The Engine is not thread-safe, so exactly one thread, the engine thread, ever calls it. The
event loop talks to that thread through a thread-safe inbox (adds and aborts), which the
thread drains before every step; outputs travel back with loop.call_soon_threadsafe, batched
once per step. The event loop therefore never blocks on model work.

Invariants:
- A request's stream ends exactly once: with its finished output, with an exception (the engine
  rejected it or failed it, its deadline passed, the server shut down), or by being closed by
  its consumer, which aborts it in the engine.
- Nothing one request sends raises out of the engine thread's loop: adds that fail are refused
  (ValueError: HTTP 400; anything else: a generic 500 naming the request, details in the log);
  a step that fails is traced to its request by the Engine itself (Engine._recover).
- Metrics are fed only from the engine thread (after each drain and each step).

One thread for all model work: `run_server` builds the Engine on the executor thread that
later steps it (`engine_executor`), and the event loop's thread runs no torch work. OpenMP
(torch's CPU threads, our int8 kernel) keeps a team of workers per thread that starts parallel
work; with two such threads on a machine with few cores, libgomp counts more threads than
cores and stops spinning between parallel regions, so every region pays a futex wake-up.
Measured on 2 cores: a small int8 product 20 -> 117 us per call, a decode step of the int8
default model 23 -> 41 ms, of the float32 one 56 -> 65 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator

from specserve.request import RequestOutput, SamplingParams

logger = logging.getLogger("specserve.server")


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    stream: "RequestStream"
    tenant: str | None = None


@dataclass
class _Abort:
    request_id: str


class EngineError(RuntimeError):
    """An error of the serving machinery, not of the request's fields: its HTTP status, type
    and code travel with it (the message never holds another request's details)."""

    status, type, code = 500, "internal_error", None

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(EngineError):
    status, type = 503, "service_unavailable"


class ShuttingDownError(EngineError):
    status, type, code = 503, "service_unavailable", "shutting_down"


class ServerBusyError(EngineError):
    status, type, code = 429, "rate_limit_error", "server_busy"


class RequestFailedError(EngineError):
    """The engine failed this request (a step failed with it alone; the log has the details)."""


class RequestTimeoutError(EngineError):
    status, type, code = 408, "timeout", "request_timeout"


class RequestStream:
    """Outputs of one or more engine requests (the n choices of one API call), in order.

    `await stream.accepted()` returns once the engine has taken every request, or raises the
    ValueError of the first one it rejected. Iterate with `async for`; `aclose()` aborts what
    is still running. A reader that falls behind is never buffered more than one output per
    request: outputs are cumulative, so a newer one replaces an unread one (their logprobs,
    which are only the new tokens', are joined), and memory stays bounded whatever the client
    does.
    """

    def __init__(self, owner: "AsyncEngine", request_ids: list[str]) -> None:
        self._owner = owner
        self.request_ids = list(request_ids)
        self._unfinished = set(request_ids)
        self._unread: dict[str, RequestOutput] = {}  # the newest unread output per request
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._pending_adds = len(request_ids)
        self._accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None

    # called on the event loop (scheduled from the engine thread)
    def _on_added(self, error: BaseException | None) -> None:
        if self._accepted.done():
            return
        if error is not None:
            self._accepted.set_exception(error)
            return
        self._pending_adds -= 1
        if self._pending_adds == 0:
            self._accepted.set_result(None)

    def _put(self, item: RequestOutput | BaseException) -> None:
        if self._closed:
            return
        if isinstance(item, BaseException) or item.error is not None:
            if isinstance(item, RequestOutput):
                self._done(item.request_id)
                item = RequestFailedError(item.error or "internal error")
            if self._error is None:
                self._error = item
        else:
            unread = self._unread.get(item.request_id)
            new = item.outputs[0].logprobs
            if unread is not None and unread.outputs[0].logprobs is not None and new is not None:
                unread.outputs[0].logprobs.extend(new)
                item.outputs[0].logprobs = unread.outputs[0].logprobs
            self._unread[item.request_id] = item
        self._ready.set()

    def _done(self, request_id: str) -> None:
        if request_id in self._unfinished:
            self._unfinished.discard(request_id)
            self._owner._release(1)

    async def accepted(self) -> None:
        try:
            await self._accepted
        except BaseException:
            await self.aclose()
            raise

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._unread:
                item = self._unread.pop(next(iter(self._unread)))
                if item.finished:
                    self._done(item.request_id)
                return item
            if self._error is not None:
                error = self._error
                await self.aclose()
                raise error
            if not self._unfinished:
                await self.aclose()
                raise StopAsyncIteration
            self._ready.clear()
            try:
                await self._ready.wait()
            except BaseException:
                await self.aclose()
                raise

    async def aclose(self) -> None:
        """Abort every request of this stream that has not finished (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for request_id in self._unfinished:
            self._owner.abort(request_id)
        self._owner._release(len(self._unfinished))
        self._unfinished.clear()
        self._owner._live.discard(self)


def engine_executor() -> ThreadPoolExecutor:
    """The engine thread (see the module docstring): build the Engine with
    `executor.submit(Engine, config).result()` and hand the executor to AsyncEngine."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-engine")


class AsyncEngine:
    """Owns an Engine and runs it continuously on its engine thread (`executor`; a new one if
    not given).

    Admission: at most `max_in_flight` engine requests (running and queued) at once; a call
    that would pass it gets ServerBusyError (HTTP 429 with Retry-After), one that could never
    fit is refused outright. `request_timeout` (seconds, None: off) ends a call that runs
    longer. `health()` is None while the engine makes progress, else why not: its thread is
    gone, no iteration of its loop finished for `stall_timeout` seconds, or the last
    FAILING_STEPS steps all failed. If the thread dies, `on_death` is called on the loop (the
    server exits non-zero so a supervisor restarts it) and every request, queued or running,
    gets an error.
    """

    FAILING_STEPS = 3

    def __init__(self, engine: Any, metrics: Any = None, stats_logger: Any = None,
                 executor: ThreadPoolExecutor | None = None, max_in_flight: int | None = None,
                 request_timeout: float | None = None, stall_timeout: float = 60.0) -> None:
        self.engine = engine
        self._executor = executor or engine_executor()
        self.metrics = metrics
        self.stats_logger = stats_logger
        self.max_in_flight = max_in_flight
        self.request_timeout = request_timeout
        self.stall_timeout = stall_timeout
        self.on_death: Any = None  # called on the loop if the engine thread dies
        self._inbox: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._live: set[RequestStream] = set()  # event loop only
        self.num_in_flight = 0  # engine requests submitted and not finished (event loop only)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: Future | None = None  # the engine loop on the executor
        self.error: BaseException | None = None
        self.draining = False  # shutting down: no new requests
        self._heartbeat = time.monotonic()  # the engine loop's last pass (engine thread)
        self._failing = 0  # consecutive failed steps (engine thread)
        self.kv_snapshot: dict[str, Any] = {}  # copied by the engine thread; read by /debug/kv

    # -- lifecycle (event loop) ---------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._running is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._stop.clear()
        self._heartbeat = time.monotonic()
        self._running = self._executor.submit(self._run)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the engine loop; False if it did not end within `timeout` seconds."""
        self._stop.set()
        self._wake.set()
        if self._running is not None:
            done, _ = wait_futures([self._running], timeout)
            if not done:
                return False
            self._running = None
        return True

    @property
    def is_alive(self) -> bool:
        return self._running is not None and not self._running.done() and self.error is None

    def health(self) -> str | None:
        """None while healthy, else the reason (for /health's 503)."""
        if not self.is_alive:
            return "the engine is not running"
        if self.draining:
            return "the server is shutting down"
        stalled = time.monotonic() - self._heartbeat
        if stalled > self.stall_timeout:
            return f"the engine has not completed a step for {stalled:.0f} s"
        if self._failing >= self.FAILING_STEPS:
            return f"the engine's last {self._failing} steps failed"
        return None

    def begin_shutdown(self, grace: float) -> None:
        """Admit nothing more; calls still running after `grace` seconds end with an error."""
        if self.draining:
            return
        self.draining = True
        assert self._loop is not None
        self._loop.call_later(grace, self._end_all, ShuttingDownError(
            "the server is shutting down; the request did not finish in time"))

    def _end_all(self, error: EngineError) -> None:
        for stream in list(self._live):
            stream._put(error)

    def _release(self, n: int) -> None:
        self.num_in_flight -= n

    # -- requests (event loop) ----------------------------------------------------------
    def check_admission(self, n: int) -> None:
        """Raise if `n` more engine requests cannot be taken now (before any work on them)."""
        if self.draining:
            raise ShuttingDownError("the server is shutting down")
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        limit = self.max_in_flight
        if limit is not None and self.num_in_flight + n > limit:
            if n > limit:
                raise ValueError(f"n: this call asks for {n} sequences (prompts x n), more than "
                                 f"the server ever holds at once ({limit})")
            raise ServerBusyError(f"the server is at capacity ({self.num_in_flight} sequences "
                                  "running or queued); retry later", retry_after=1.0)

    async def add_requests(self, requests: list[tuple[str, list[int], SamplingParams, str | None]],
                           tenant: str | None = None) -> RequestStream:
        """Submit requests that share one stream (sent by `tenant`); returns once the engine has
        accepted all."""
        self.check_admission(len(requests))
        stream = RequestStream(self, [r[0] for r in requests])
        self.num_in_flight += len(requests)
        self._live.add(stream)
        if self.request_timeout is not None:
            assert self._loop is not None
            stream._timer = self._loop.call_later(self.request_timeout, stream._put, RequestTimeoutError(
                f"the request ran longer than the server's limit of {self.request_timeout:g} s"))
        self._submit(requests, stream, tenant)
        await stream.accepted()
        return stream

    def _submit(self, requests: list[tuple[str, list[int], SamplingParams, str | None]],
                stream: RequestStream, tenant: str | None) -> None:
        """Hand a stream's requests to the engine thread (replicas.ReplicaRouter: to the
        replica processes); each answers on `stream._on_added`."""
        for request_id, token_ids, params, prompt in requests:
            self._inbox.put(_Add(request_id, list(token_ids), params, prompt, stream, tenant))
        self._wake.set()
        if self.error is not None:  # died meanwhile: nobody will drain the inbox
            self._fail_inbox()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, prompt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; closing or cancelling the generator aborts it."""
        stream = await self.add_requests([(request_id, prompt_token_ids, params, prompt)])
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Thread-safe; unknown or finished ids are ignored by the engine."""
        self._inbox.put(_Abort(request_id))
        self._wake.set()

    # -- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._heartbeat = time.monotonic()
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._after_step([])
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                if self._failing:  # every step failing: do not spin (nor flood the log)
                    time.sleep(min(1.0, 0.01 * 2 ** self._failing))
                failed_before = self._num_failed_steps()
                try:
                    outputs = self.engine.step()
                except Exception:  # noqa: BLE001 - the engine recovers its own; a last resort
                    logger.exception("engine step failed")
                    self._failing += 1
                    self._fail_all(RequestFailedError("internal error while generating; the "
                                                      "server log has the details"))
                    continue
                self._failing = self._failing + 1 if self._num_failed_steps() > failed_before else 0
                self._after_step(outputs)  # first, so /metrics is current once a client sees output
                self._deliver(outputs)
        except BaseException as e:  # noqa: BLE001
            logger.exception("engine thread died")
            self.error = e
            self._fail_all(EngineDeadError("the engine stopped; the server is restarting"))
            self._fail_inbox()
            if self.on_death is not None:
                self._call_soon([(self.on_death, e)])

    def _num_failed_steps(self) -> int:
        return getattr(self.engine, "num_failed_steps", 0)

    def _take_inbox(self) -> Iterator[_Add | _Abort]:
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        deliveries = []
        for item in self._take_inbox():
            if isinstance(item, _Abort):
                self.engine.abort_request(item.request_id)
                self._streams.pop(item.request_id, None)
                if self.metrics is not None:
                    self.metrics.forget(item.request_id)
                continue
            error: BaseException | None = None
            try:
                self.engine.add_request(item.request_id, item.prompt_token_ids, item.params,
                                        prompt=item.prompt, tenant=item.tenant)
                self._streams[item.request_id] = item.stream
            except (ValueError, TypeError) as e:
                error = e if isinstance(e, ValueError) else ValueError(str(e))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException:  # noqa: BLE001 - one request's input must not stop the engine
                logger.exception("adding request %s failed", item.request_id)
                error = RequestFailedError(f"internal error while accepting this request "
                                           f"({item.request_id}); the server log has the details")
            deliveries.append((item.stream._on_added, error))
        if deliveries:
            self._call_soon(deliveries)

    def _fail_inbox(self) -> None:
        """The engine is gone: every request still in the inbox is refused."""
        dead = EngineDeadError("the engine stopped; the server is restarting")
        deliveries = [(item.stream._on_added, dead) for item in self._take_inbox()
                      if isinstance(item, _Add)]
        if deliveries:
            self._call_soon(deliveries)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        deliveries = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if output.finished:
                del self._streams[output.request_id]
            deliveries.append((stream._put, output))
        if deliveries:
            self._call_soon(deliveries)

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        stats = self.engine.stats
        if self.metrics is not None:
            now = time.time()
            for output in outputs:
                self.metrics.observe_output(output, now)
            self.metrics.update_from_stats(stats)
        if self.stats_logger is not None:
            self.stats_logger.maybe_log(stats)
        self.kv_snapshot = {"num_free_blocks": getattr(stats, "num_free_blocks", None),
                            "num_total_blocks": getattr(stats, "num_total_blocks", None),
                            "kv_cache_usage": stats.kv_cache_usage,
                            "num_running": stats.num_running, "num_waiting": stats.num_waiting}

    def _fail_all(self, error: BaseException) -> None:
        deliveries = []
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001
                pass
            deliveries.append((stream._put, error))
        self._streams.clear()
        if deliveries:
            self._call_soon(deliveries)

    def _call_soon(self, deliveries: list[tuple[Any, Any]]) -> None:
        def run() -> None:
            for fn, arg in deliveries:
                fn(arg)
        self._to_loop(run)

    def _to_loop(self, fn: Any, *args: Any) -> None:
        """fn(*args) on the event loop, from another thread; dropped once the loop is closed
        (nobody is listening any more)."""
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)
