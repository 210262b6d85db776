"""The bridge between the event loop and the engine thread (specserve.server.async_engine) and
the app's last-resort error handling, in process: bounded streams for slow readers, a dead
engine thread, the queue limit, a 500 that keeps the connection open."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import httpx
import pytest

from specserve import SamplingParams
from specserve.request import CompletionOutput, RequestOutput, TokenLogprob
from specserve.server.async_engine import (AsyncEngine, EngineDeadError, RequestStream,
                                           RequestTimeoutError, ServerBusyError)


@pytest.fixture(scope="module")
def engine(make_llm, tiny_model_dir):
    return make_llm(str(tiny_model_dir), max_model_len=256, speculative_config=None,
                    num_blocks=64).engine


def settle(engine) -> None:
    """After the engine thread stopped: let the engine finish what was aborted."""
    for rid in list(engine.requests):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def before_each_step(monkeypatch, engine, before) -> None:
    """engine.step() runs before() first: a stall or a fault injected into the real step."""
    real = engine.step

    def step():
        before()
        return real()

    monkeypatch.setattr(engine, "step", step)


def output(rid: str, n: int, finished: bool = False) -> RequestOutput:
    tokens = list(range(n))
    return RequestOutput(rid, None, [1], [CompletionOutput(
        0, "x" * n, tokens, "length" if finished else None,
        logprobs=[TokenLogprob(n - 1, -0.5)])], finished)


def test_a_reader_that_falls_behind_holds_one_output_per_request(engine):
    async def main() -> None:
        ae = AsyncEngine(engine)
        stream = RequestStream(ae, ["a", "b"])
        for n in range(1, 1001):  # 1,000 steps, nobody reading
            stream._put(output("a", n))
            if n <= 3:
                stream._put(output("b", n))
        assert len(stream._unread) == 2  # not 1,003 outputs
        first = await stream.__anext__()
        assert first.request_id == "a" and len(first.outputs[0].token_ids) == 1000
        assert [lp.token_id for lp in first.outputs[0].logprobs] == list(range(1000))
        second = await stream.__anext__()
        assert second.request_id == "b" and len(second.outputs[0].logprobs) == 3
        stream._put(output("a", 1001, finished=True))
        stream._put(output("b", 4, finished=True))
        assert [o.finished async for o in stream] == [True, True]
    asyncio.run(main())


def test_the_queue_limit_refuses_past_capacity(engine):
    async def main() -> None:
        ae = AsyncEngine(engine, max_in_flight=4)
        ae.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            stream = await ae.add_requests([(f"q{i}", [1, 2, 3], params, None) for i in range(3)])
            assert ae.num_in_flight == 3
            with pytest.raises(ServerBusyError):
                ae.check_admission(2)
            with pytest.raises(ValueError, match="more than the server ever holds"):
                ae.check_admission(5)
            await stream.aclose()  # aborts them: capacity is back
            assert ae.num_in_flight == 0
            ae.check_admission(4)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, ae.stop)
            settle(engine)
    asyncio.run(main())


def test_a_request_past_its_deadline_ends_with_a_timeout(engine, monkeypatch):
    async def main() -> None:
        ae = AsyncEngine(engine, request_timeout=0.5)
        ae.start()
        try:
            before_each_step(monkeypatch, engine, lambda: time.sleep(0.1))
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            stream = await ae.add_requests([("t0", [1, 2, 3], params, None)])
            with pytest.raises(RequestTimeoutError):
                async for _ in stream:
                    pass
            assert ae.num_in_flight == 0  # aborted and released
        finally:
            await asyncio.get_running_loop().run_in_executor(None, ae.stop)
            monkeypatch.undo()
            settle(engine)
    asyncio.run(main())


def test_a_dead_engine_thread_fails_everyone_and_says_so(engine, monkeypatch):
    """A BaseException out of a step kills the thread: running and later requests get
    EngineDeadError, /health's reason is set, and the server's on_death hook runs."""
    async def main() -> None:
        died = asyncio.Event()
        ae = AsyncEngine(engine)
        ae.on_death = lambda error: died.set()
        ae.start()
        try:
            calls = itertools.count()

            def die_at_the_third_step() -> None:
                if next(calls) >= 2:
                    raise SystemExit("injected")

            before_each_step(monkeypatch, engine, die_at_the_third_step)
            params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
            stream = await ae.add_requests([("d0", [1, 2, 3], params, None)])
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            await asyncio.wait_for(died.wait(), 10)
            assert ae.health() == "the engine is not running"
            with pytest.raises(EngineDeadError):
                await ae.add_requests([("d1", [1, 2, 3], params, None)])
        finally:
            monkeypatch.undo()
            await asyncio.get_running_loop().run_in_executor(None, ae.stop)
            settle(engine)
    asyncio.run(main())


def test_an_unhandled_error_is_a_500_that_keeps_the_connection():
    """Starlette's last resort re-raises after its 500, and uvicorn then closes the
    connection; the app's CatchAllMiddleware answers without re-raising."""
    import uvicorn
    from fastapi import FastAPI

    from specserve.server.app import CatchAllMiddleware, install_error_handlers
    from tests.server_fixtures import free_port

    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(CatchAllMiddleware)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internals")

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            r = client.get("/boom")
            assert r.status_code == 500
            assert r.json()["error"]["type"] == "internal_error"
            assert "secret" not in r.text
            sock = r.extensions["network_stream"].get_extra_info("socket")
            again = client.get("/ok")
            assert again.status_code == 200
            assert again.extensions["network_stream"].get_extra_info("socket") is sock
    finally:
        server.should_exit = True
        thread.join(10)
