"""AsyncEngine: the bridge between the asyncio server and the (synchronous) Engine.

The Engine is not thread-safe, so exactly one thread, the engine thread, ever calls it. The
event loop talks to that thread through a thread-safe inbox (adds and aborts), which the
thread drains before every step; outputs travel back with loop.call_soon_threadsafe, batched
once per step. The event loop therefore never blocks on model work.

Invariants:
- A request's stream ends exactly once: with its finished output, with an exception (the engine
  rejected it or failed), or by being closed by its consumer, which aborts it in the engine.
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
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, AsyncIterator

from specserve.request import RequestOutput, SamplingParams

logger = logging.getLogger("specserve.server")


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    stream: "RequestStream"


@dataclass
class _Abort:
    request_id: str


class EngineDeadError(RuntimeError):
    pass


class RequestStream:
    """Outputs of one or more engine requests (the n choices of one API call), in order.

    `await stream.accepted()` returns once the engine has taken every request, or raises the
    ValueError of the first one it rejected. Iterate with `async for`; `aclose()` aborts what
    is still running.
    """

    def __init__(self, owner: "AsyncEngine", request_ids: list[str]) -> None:
        self._owner = owner
        self.request_ids = list(request_ids)
        self._unfinished = set(request_ids)
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._pending_adds = len(request_ids)
        self._accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._closed = False

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
        self._queue.put_nowait(item)

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
        if not self._unfinished:
            self._closed = True
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    async def aclose(self) -> None:
        """Abort every request of this stream that has not finished (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for request_id in self._unfinished:
            self._owner.abort(request_id)
        self._unfinished.clear()


def engine_executor() -> ThreadPoolExecutor:
    """The engine thread (see the module docstring): build the Engine with
    `executor.submit(Engine, config).result()` and hand the executor to AsyncEngine."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-engine")


class AsyncEngine:
    """Owns an Engine and runs it continuously on its engine thread (`executor`; a new one if
    not given)."""

    def __init__(self, engine: Any, metrics: Any = None, stats_logger: Any = None,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        self._executor = executor or engine_executor()
        self.metrics = metrics
        self.stats_logger = stats_logger
        self._inbox: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: Future | None = None  # the engine loop on the executor
        self.error: BaseException | None = None
        self.kv_snapshot: dict[str, Any] = {}  # copied by the engine thread; read by /debug/kv

    # -- lifecycle (event loop) ---------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._running is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._stop.clear()
        self._running = self._executor.submit(self._run)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._running is not None:
            wait_futures([self._running], timeout)
            self._running = None

    @property
    def is_alive(self) -> bool:
        return self._running is not None and not self._running.done() and self.error is None

    # -- requests (event loop) ----------------------------------------------------------
    async def add_requests(self, requests: list[tuple[str, list[int], SamplingParams, str | None]]
                           ) -> RequestStream:
        """Submit requests that share one stream; returns once the engine has accepted all."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        stream = RequestStream(self, [r[0] for r in requests])
        for request_id, token_ids, params, prompt in requests:
            self._inbox.put(_Add(request_id, list(token_ids), params, prompt, stream))
        self._wake.set()
        await stream.accepted()
        return stream

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
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._after_step([])
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - fail the live requests, keep serving
                    logger.exception("engine step failed")
                    self._fail_all(e)
                    continue
                self._after_step(outputs)  # first, so /metrics is current once a client sees output
                self._deliver(outputs)
        except BaseException as e:  # noqa: BLE001
            logger.exception("engine thread died")
            self.error = e
            self._fail_all(EngineDeadError(f"engine thread died: {e!r}"))

    def _drain_inbox(self) -> None:
        deliveries = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Abort):
                self.engine.abort_request(item.request_id)
                self._streams.pop(item.request_id, None)
                if self.metrics is not None:
                    self.metrics.forget(item.request_id)
                continue
            error: BaseException | None = None
            try:
                self.engine.add_request(item.request_id, item.prompt_token_ids, item.params,
                                        prompt=item.prompt)
                self._streams[item.request_id] = item.stream
            except (ValueError, TypeError) as e:
                error = e if isinstance(e, ValueError) else ValueError(str(e))
            deliveries.append((item.stream._on_added, error))
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
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(run)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more
