"""Data-parallel replicas: N engine processes behind the one HTTP frontend (--data-parallel-size).

Process layout. The frontend process runs uvicorn, the API layer and a `ReplicaRouter`, which
has AsyncEngine's interface (add_requests / streams / abort, admission, health), so the API
layer cannot tell it from one engine. Each replica is a process of its own (multiprocessing
spawn) that builds a full Engine and steps it in its main thread (`_replica_main`). Two
one-way pipes join the frontend to each replica:

  frontend -> replica: batches of commands: ("add", id, prompt token ids, SamplingParams,
      prompt, tenant, arrival time), ("abort", id), ("stop",)
  replica -> frontend: ("ready", facts) once, then ("added", [(id, error kind, message)]),
      ("step", [RequestOutput], EngineStats, failing steps) after every step (and once a second
      while idle, as a heartbeat), ("failed", [id], message) when a step raised past the
      engine's own recovery.

A writer thread per replica sends the commands (the event loop never blocks on a full pipe),
and a reader thread receives the replica's messages and hands them to the event loop.
Outputs travel without their prompt (the frontend puts it back). A replica compiles a
request's grammar on a thread of its own before adding it, so a slow grammar does not hold
up that replica's other requests (the frontend has already compiled it once within the time
limit, which is how a bad or slow grammar is refused with a 400).

Routing (`PrefixAffinity`, `ReplicaRouter._route`): the frontend keeps, per replica, the
prefix-cache keys (kv_cache.manager.block_keys, the replica's own keys) of the prompts it sent
there and of their finished outputs, the most recent `capacity` of them (as many as the
replica's KV cache has blocks). A request goes to the replica holding the longest run of its
leading blocks, unless that replica has more than `affinity_slack` requests in flight beyond
the least loaded one; otherwise (no replica holds any of it) to the least loaded: fewest
requests in flight, then fewest prompt tokens in flight, then fewest requests routed so far
(idle traffic alternates).

Threads: on a CPU each replica gets an equal share of the frontend's torch threads
(`torch.set_num_threads(total // N)`, at least one); on CUDA replica i takes the visible GPUs
i * T to i * T + T - 1 (T: the tensor-parallel size), modulo their count: with fewer GPUs,
replicas share them. Every replica has its own KV cache of the configured size.

Failure: a replica process that ends unasked (killed, crashed) fails its in-flight requests
with EngineDeadError (HTTP 503, or an error event in a stream), turns /health to 503 and
calls `on_death`, on which the server shuts down and exits 1. Replicas ignore SIGINT (the
frontend stops them) and exit by themselves when the frontend's pipe closes.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import connection
from types import SimpleNamespace
from typing import Any

from specserve.config import EngineConfig
from specserve.kv_cache.manager import block_keys
from specserve.request import RequestOutput, SamplingParams
from specserve.server.async_engine import (AsyncEngine, EngineDeadError, RequestFailedError,
                                           RequestStream)

logger = logging.getLogger("specserve.server")

HEARTBEAT_S = 1.0  # an idle replica reports at least this often
FAILING_STEPS = AsyncEngine.FAILING_STEPS


class ReplicaStartError(RuntimeError):
    """A replica did not start (its engine raised, or its process ended)."""


# -- the replica process ---------------------------------------------------------------------

def _replica_main(index: int, config: EngineConfig, commands: connection.Connection,
                  results: connection.Connection, num_threads: int, cuda_devices: str | None,
                  stats_interval: float, log_level: str) -> None:
    """A replica process: build the engine, report its facts, then serve commands and step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the frontend, which stops us
    if cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s replica {index} %(name)s: %(message)s")
    import torch

    from specserve.engine import Engine
    from specserve.metrics import StatsLogger

    torch.set_num_threads(num_threads)
    try:
        engine = Engine(config)
    except Exception as e:  # noqa: BLE001 - reported to the frontend, which exits
        logger.exception("the engine of replica %d did not start", index)
        results.send(("failed", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    facts = {"model_dir": str(engine.model_dir), "model_name": engine.model_name,
             "model_aliases": list(engine.model_aliases), "vocab_size": engine.arch.vocab_size,
             "max_model_len": engine.max_model_len, "max_request_tokens": engine.max_request_tokens,
             "max_drafts": engine.spec.max_drafts, "block_size": engine.kv.block_size,
             "num_total_blocks": engine.kv.num_total_blocks,
             "eos_token_ids": sorted(engine.eos_token_ids), "pid": os.getpid(),
             "device": str(engine.runner.device), "num_threads": torch.get_num_threads()}
    results.send(("ready", facts))
    log = StatsLogger(stats_interval, logging.getLogger(f"specserve.replica{index}"))
    try:
        _ReplicaLoop(engine, commands, results, log).run()
    except _FrontendGone:
        pass
    # Stopped as asked (or the frontend is gone): the engine's own processes (tensor-parallel
    # workers) are stopped, then nothing is left to flush but the log, and the interpreter's
    # teardown of torch and its threads takes seconds.
    try:
        engine.shutdown()
    except Exception:  # noqa: BLE001 - exiting anyway
        logger.exception("replica %d: stopping the engine failed", index)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _FrontendGone(Exception):
    pass


class _ReplicaLoop:
    """The replica's main loop: the rules of AsyncEngine's engine thread, over pipes."""

    def __init__(self, engine: Any, commands: connection.Connection,
                 results: connection.Connection, stats_logger: Any) -> None:
        self.engine, self.commands, self.results, self.log = engine, commands, results, stats_logger
        self.live: set[str] = set()  # added, not finished or aborted
        self.failing = 0
        self.grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="specserve-grammar")
        self.compiling: list[tuple[Future, tuple]] = []  # adds waiting for their grammar
        self.added: list[tuple[str, str | None, str | None]] = []
        self.last_sent = 0.0

    def send(self, message: tuple) -> None:
        try:
            self.results.send(message)
        except (OSError, EOFError):
            raise _FrontendGone() from None
        self.last_sent = time.monotonic()

    def run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            if not self.take_commands(0.0 if busy else 0.01 if self.compiling else HEARTBEAT_S):
                return
            self.finish_compiled()
            if self.added:
                self.send(("added", self.added))
                self.added = []
            if not engine.has_unfinished_requests():
                if time.monotonic() - self.last_sent >= HEARTBEAT_S / 2:
                    self.send(("step", [], engine.stats, self.failing))  # heartbeat
                continue
            if self.failing:  # every step failing: do not spin (nor flood the log)
                time.sleep(min(1.0, 0.01 * 2 ** self.failing))
            failed_before = engine.num_failed_steps
            try:
                outputs = engine.step()
            except Exception:  # noqa: BLE001 - the engine recovers its own; a last resort
                logger.exception("engine step failed")
                self.failing += 1
                ids = sorted(self.live)
                for rid in ids:
                    engine.abort_request(rid)
                self.live.clear()
                self.send(("failed", ids, "internal error while generating; the server log "
                                          "has the details"))
                continue
            self.failing = self.failing + 1 if engine.num_failed_steps > failed_before else 0
            for out in outputs:
                if out.finished:
                    self.live.discard(out.request_id)
                out.prompt_token_ids, out.prompt = [], None  # the frontend has them
            stats = engine.stats
            self.log.maybe_log(stats)
            self.send(("step", outputs, stats, self.failing))

    def take_commands(self, timeout: float) -> bool:
        """Carry out what the frontend sent; False once told to stop (or the frontend is gone)."""
        try:
            ready = self.commands.poll(timeout)
            while ready:
                for command in self.commands.recv():
                    if command[0] == "stop":
                        return False
                    if command[0] == "abort":
                        self.engine.abort_request(command[1])
                        self.live.discard(command[1])
                        self.compiling = [(f, c) for f, c in self.compiling if c[1] != command[1]]
                    else:
                        self.add(command)
                ready = self.commands.poll(0)
        except (EOFError, OSError):
            return False
        return True

    def add(self, command: tuple) -> None:
        params: SamplingParams = command[3]
        if params.structured is not None:  # compiled off this loop (cached for the add)
            spec, engine = params.structured, self.engine
            self.compiling.append((self.grammar_pool.submit(lambda: engine.grammars.compile(spec)),
                                   command))
            return
        self.add_now(command)

    def finish_compiled(self) -> None:
        if not self.compiling:
            return
        waiting = []
        for future, command in self.compiling:
            if future.done():
                self.add_now(command)  # a failed compile fails again in add_request: its 400
            else:
                waiting.append((future, command))
        self.compiling = waiting

    def add_now(self, command: tuple) -> None:
        _, rid, token_ids, params, prompt, tenant, arrival = command
        try:
            self.engine.add_request(rid, token_ids, params, prompt=prompt, arrival_time=arrival,
                                    tenant=tenant)
            self.live.add(rid)
            self.added.append((rid, None, None))
        except (ValueError, TypeError) as e:
            self.added.append((rid, "value", str(e)))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 - one request's input must not stop the replica
            logger.exception("adding request %s failed", rid)
            self.added.append((rid, "internal", f"internal error while accepting this request "
                                                f"({rid}); the server log has the details"))


# -- the frontend ----------------------------------------------------------------------------

class ReplicaEngineView:
    """The replicas' engine as the API layer reads it (ServingContext: tokenizer, names,
    limits, validate, grammars), in the frontend process, from the facts replica 0 reported.
    `validate` and `grammars` are the Engine's own, run on these facts, so a request the
    replicas would refuse is a 400 before it is routed."""

    def __init__(self, facts: dict[str, Any]) -> None:
        from transformers import AutoTokenizer

        self.facts = facts
        self.tokenizer = AutoTokenizer.from_pretrained(facts["model_dir"])
        self.model_name = facts["model_name"]
        self.model_aliases = list(facts["model_aliases"])
        self.vocab_size = facts["vocab_size"]
        self.max_model_len = facts["max_model_len"]
        self.max_request_tokens = facts["max_request_tokens"]
        self.eos_token_ids = set(facts["eos_token_ids"])
        self.arch = SimpleNamespace(vocab_size=facts["vocab_size"])
        self.kv = SimpleNamespace(block_size=facts["block_size"],
                                  num_total_blocks=facts["num_total_blocks"])
        self.spec = SimpleNamespace(max_drafts=facts["max_drafts"], grammars=None)
        self._grammars_lock = threading.Lock()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 compile_grammar: bool = True) -> None:
        from specserve.engine import Engine

        Engine.validate(self, prompt_token_ids, params, compile_grammar)  # type: ignore[arg-type]

    @property
    def grammars(self) -> Any:
        from specserve.engine import Engine

        return Engine.grammars.fget(self)  # type: ignore[attr-defined]


class PrefixAffinity:
    """Per replica, the prefix-cache keys of the token sequences sent there, most recently
    used last, at most `capacity` each (a replica holds no more blocks than that)."""

    def __init__(self, num_replicas: int, block_size: int, capacity: int) -> None:
        self.block_size, self.capacity = block_size, max(1, capacity)
        self.records: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]

    def keys(self, token_ids: list[int]) -> list[bytes]:
        return block_keys(token_ids, self.block_size)

    def extend(self, keys: list[bytes], token_ids: list[int]) -> list[bytes]:
        """The keys of token_ids' full blocks, given `keys`, those of its first len(keys) blocks."""
        done = len(keys) * self.block_size
        return keys + block_keys(token_ids[done:], self.block_size, keys[-1]) if keys else self.keys(token_ids)

    def cached_blocks(self, replica: int, keys: list[bytes]) -> int:
        """How many of the leading blocks the replica was sent (keys are chained: a run)."""
        record, n = self.records[replica], 0
        for key in keys:
            if key not in record:
                break
            n += 1
        return n

    def record(self, replica: int, keys: list[bytes]) -> None:
        record = self.records[replica]
        for key in keys:
            record[key] = None
            record.move_to_end(key)
        while len(record) > self.capacity:
            record.popitem(last=False)

    def clear(self, replica: int) -> None:
        self.records[replica].clear()


@dataclass
class _Live:
    stream: RequestStream
    prompt_token_ids: list[int]
    prompt: str | None
    keys: list[bytes]
    accepted: bool = False


@dataclass
class Replica:
    """The frontend's handle on one replica process."""

    index: int
    process: Any  # multiprocessing.Process
    commands: connection.Connection  # frontend -> replica
    results: connection.Connection  # replica -> frontend
    facts: dict[str, Any] = field(default_factory=dict)
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    live: dict[str, _Live] = field(default_factory=dict)  # event loop only
    prompt_tokens_in_flight: int = 0
    routed: int = 0
    stats: Any = None
    heartbeat: float = field(default_factory=time.monotonic)
    failing: int = 0
    dead: bool = False
    threads: list[threading.Thread] = field(default_factory=list)

    def load(self) -> tuple[int, int, int]:
        return len(self.live), self.prompt_tokens_in_flight, self.routed

    def send(self, command: tuple) -> None:
        self.outbox.put(command)

    def _write(self) -> None:
        """Writer thread: the outbox to the pipe, in batches."""
        while True:
            batch = [self.outbox.get()]
            while True:
                try:
                    batch.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            done = batch[-1] is None
            batch = [c for c in batch if c is not None]
            try:
                if batch:
                    self.commands.send(batch)
            except (OSError, EOFError, ValueError):
                return  # the replica is gone: its reader reports it
            if done:
                return


def pick_replica(replicas: list[Replica], hits: list[int], slack: int) -> tuple[Replica, str]:
    """The replica for a request, and why: the one holding the most leading blocks of its
    prompt (`hits`, per replica), unless it has more than `slack` requests in flight beyond
    the least loaded; else the least loaded (requests, then prompt tokens in flight, then
    requests routed so far)."""
    least = min(replicas, key=Replica.load)
    best = max(range(len(replicas)), key=lambda i: (hits[i], -len(replicas[i].live), -i))
    if hits[best] > 0 and len(replicas[best].live) - len(least.live) <= slack:
        return replicas[best], "prefix"
    return least, "load"


def launch_replicas(config: EngineConfig, num_replicas: int, stats_interval: float = 5.0,
                    log_level: str = "info") -> list[Replica]:
    """Start `num_replicas` replica processes and wait until every engine is built (raises
    ReplicaStartError, having stopped the others, if one fails)."""
    import multiprocessing

    import torch

    ctx = multiprocessing.get_context("spawn")
    threads = max(1, torch.get_num_threads() // num_replicas)
    gpus = _visible_gpus(config)
    per = getattr(config.model, "tensor_parallel_size", 1)  # GPUs per replica
    if gpus is not None and len(gpus) < num_replicas * per:
        logger.warning("%d replicas of %d GPU(s) each share %d GPU(s)", num_replicas, per,
                       len(gpus))
    replicas: list[Replica] = []
    # not daemonic: a replica may start processes of its own (tensor-parallel workers); the
    # exit handler stops whatever is left when the frontend exits without stopping them
    atexit.register(_stop_processes, replicas, 5.0)
    for i in range(num_replicas):
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        res_recv, res_send = ctx.Pipe(duplex=False)
        devices = ",".join(gpus[(i * per + k) % len(gpus)] for k in range(per)) if gpus else None
        process = ctx.Process(target=_replica_main, name=f"specserve-replica-{i}",
                              args=(i, config, cmd_recv, res_send, threads, devices,
                                    stats_interval, log_level))
        process.start()
        cmd_recv.close()  # the replica's ends: ours closed, so its death reads as EOF here
        res_send.close()
        replicas.append(Replica(i, process, cmd_send, res_recv))
    logger.info("started %d replicas (pids %s), %d torch thread(s) each", num_replicas,
                ", ".join(str(r.process.pid) for r in replicas), threads)
    try:
        pending = {r.results: r for r in replicas}
        while pending:
            for ready in connection.wait(list(pending)):
                r = pending.pop(ready)
                try:
                    message = ready.recv()
                except (EOFError, OSError):  # our copy of its end is closed: EOF is its death
                    r.process.join(5)
                    raise ReplicaStartError(f"replica {r.index} ended while starting (exit "
                                            f"code {r.process.exitcode})") from None
                if message[0] == "failed":
                    raise ReplicaStartError(f"replica {r.index}: {message[1]}")
                r.facts = message[1]
    except BaseException:
        _stop_processes(replicas, 5.0)
        raise
    for r in replicas:
        writer = threading.Thread(target=r._write, name=f"specserve-replica{r.index}-writer",
                                  daemon=True)
        writer.start()
        r.threads.append(writer)
    return replicas


def _visible_gpus(config: EngineConfig) -> list[str] | None:
    """The GPU ids replicas are spread over, or None on a CPU."""
    import torch

    device = config.model.device
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()]
    return [str(i) for i in range(max(1, torch.cuda.device_count()))]


def _stop_processes(replicas: list[Replica], timeout: float) -> bool:
    """Ask every replica to stop, then terminate and kill what is left; True if all ended."""
    for r in replicas:
        r.send(("stop",))
        r.send(None)
        if not r.threads:  # no writer yet (still starting): say it directly
            try:
                r.commands.send([("stop",)])
            except (OSError, EOFError, ValueError):
                pass
    deadline = time.monotonic() + timeout
    for r in replicas:
        r.process.join(max(0.0, deadline - time.monotonic()))
    for r in replicas:
        if r.process.is_alive():
            logger.warning("replica %d did not stop in time: terminating it", r.index)
            r.process.terminate()
            r.process.join(2)
        if r.process.is_alive():
            r.process.kill()
            r.process.join(2)
    for r in replicas:
        for thread in r.threads:  # they end at the pipes' EOF: then the pipes can close
            if thread is not threading.current_thread():
                thread.join(1.0)
        for end in (r.commands, r.results):
            try:
                end.close()
            except OSError:
                pass
    return not any(r.process.is_alive() for r in replicas)


class ReplicaRouter(AsyncEngine):
    """AsyncEngine's interface over replica processes (see the module docstring): requests are
    routed by prefix-cache affinity, else to the least loaded replica; outputs come back
    through each replica's reader thread, on the event loop. `engine` is a ReplicaEngineView.

    Admission, the request timeout, shutdown's grace period and the streams are AsyncEngine's.
    `health()` names the first replica that is dead, stalled (no report for `stall_timeout`
    seconds) or failing (its last FAILING_STEPS steps failed).
    """

    def __init__(self, replicas: list[Replica], metrics: Any = None,
                 max_in_flight: int | None = None, request_timeout: float | None = None,
                 stall_timeout: float = 60.0, affinity_slack: int | None = None,
                 max_num_seqs: int = 64, engine_view: ReplicaEngineView | None = None) -> None:
        from specserve.engine import EngineStats
        from specserve.metrics import ReplicaMetrics, ServerMetrics

        view = engine_view or ReplicaEngineView(replicas[0].facts)
        super().__init__(view, metrics, None, None, max_in_flight, request_timeout, stall_timeout)
        self.replicas = replicas
        for r in replicas:  # until its first report: idle, every block free
            blocks = r.facts.get("num_total_blocks", 0)
            r.stats = EngineStats(num_free_blocks=blocks, num_total_blocks=blocks)
        self.affinity_slack = max(4, max_num_seqs // 4) if affinity_slack is None else affinity_slack
        self.affinity = PrefixAffinity(len(replicas), view.kv.block_size,
                                       view.kv.num_total_blocks)
        self._where: dict[str, Replica] = {}  # request id -> its replica (event loop only)
        self._stopping = False
        self._started = False
        if metrics is None:  # build_app makes one when not given: made here to share its registry
            self.metrics = ServerMetrics(view.model_name)
        self.replica_metrics = ReplicaMetrics(self.metrics.model_name, len(replicas),
                                              self.metrics.registry)
        self.kv_snapshot = self._snapshot(self._total_stats())

    # -- lifecycle (event loop) ---------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._started:
            return
        self._started = True
        self._loop = loop or asyncio.get_running_loop()
        now = time.monotonic()
        for r in self.replicas:
            r.heartbeat = now
            reader = threading.Thread(target=self._read, args=(r,), daemon=True,
                                      name=f"specserve-replica{r.index}-reader")
            reader.start()
            r.threads.append(reader)

    def stop(self, timeout: float = 10.0) -> bool:
        self._stopping = True
        return _stop_processes(self.replicas, timeout)

    @property
    def is_alive(self) -> bool:
        return (self._started and not self._stopping and self.error is None
                and not any(r.dead for r in self.replicas))

    def health(self) -> str | None:
        if self.error is not None or any(r.dead for r in self.replicas):
            dead = [r.index for r in self.replicas if r.dead]
            return f"replica {dead[0] if dead else '?'} is not running"
        if not self.is_alive:
            return "the engine is not running"
        if self.draining:
            return "the server is shutting down"
        now = time.monotonic()
        for r in self.replicas:
            stalled = now - r.heartbeat
            if stalled > self.stall_timeout:
                return f"replica {r.index} has not completed a step for {stalled:.0f} s"
            if r.failing >= FAILING_STEPS:
                return f"replica {r.index}'s last {r.failing} steps failed"
        return None

    # -- requests (event loop) ----------------------------------------------------------
    def _submit(self, requests: list[tuple[str, list[int], SamplingParams, str | None]],
                stream: RequestStream, tenant: str | None) -> None:
        now = time.time()
        for request_id, token_ids, params, prompt in requests:
            if not self.is_alive:
                stream._on_added(EngineDeadError("the engine stopped; the server is restarting"))
                return
            ids = list(token_ids)
            keys = self.affinity.keys(ids)
            replica, reason = self._route(keys)
            replica.routed += 1
            replica.live[request_id] = _Live(stream, ids, prompt, keys)
            replica.prompt_tokens_in_flight += len(ids)
            self._where[request_id] = replica
            self.affinity.record(replica.index, keys)
            self.replica_metrics.routed_to(replica.index, reason)
            self.replica_metrics.set_in_flight(replica.index, len(replica.live))
            replica.send(("add", request_id, ids, params, prompt, tenant, now))

    def _route(self, keys: list[bytes]) -> tuple[Replica, str]:
        alive = [r for r in self.replicas if not r.dead]
        hits = [self.affinity.cached_blocks(r.index, keys) for r in alive]
        return pick_replica(alive, hits, self.affinity_slack)

    def abort(self, request_id: str) -> None:
        replica = self._where.pop(request_id, None)
        if replica is None:
            return
        self._forget(replica, request_id)
        replica.send(("abort", request_id))
        if self.metrics is not None:
            self.metrics.forget(request_id)

    def _forget(self, replica: Replica, request_id: str) -> _Live | None:
        live = replica.live.pop(request_id, None)
        if live is not None:
            replica.prompt_tokens_in_flight -= len(live.prompt_token_ids)
            self.replica_metrics.set_in_flight(replica.index, len(replica.live))
        return live

    # -- replica messages (reader threads -> event loop) ----------------------------------
    def _read(self, replica: Replica) -> None:
        """Reader thread: the replica's messages to the event loop, then its end."""
        while True:
            try:
                message = replica.results.recv()
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 - a message that does not unpickle: a bug
                logger.exception("replica %d sent a message that could not be read", replica.index)
                break
            self._to_loop(self._on_message, replica, message)
        connection.wait([replica.process.sentinel], 1.0)  # its exit code, once it has one
        self._to_loop(self._on_exit, replica)

    def _on_message(self, replica: Replica, message: tuple) -> None:
        kind = message[0]
        replica.heartbeat = time.monotonic()
        if kind == "added":
            for rid, error_kind, text in message[1]:
                live = replica.live.get(rid)
                if live is None:
                    continue  # aborted meanwhile
                if error_kind is None:
                    live.accepted = True
                    live.stream._on_added(None)
                    continue
                self._where.pop(rid, None)
                self._forget(replica, rid)
                live.stream._on_added(ValueError(text) if error_kind == "value"
                                      else RequestFailedError(text))
        elif kind == "step":
            _, outputs, stats, failing = message
            replica.stats, replica.failing = stats, failing
            total = self._total_stats()
            self._update_metrics(replica, outputs, total)  # first: /metrics is current once output is seen
            for out in outputs:
                self._deliver(replica, out)
            self.kv_snapshot = self._snapshot(total)
        elif kind == "failed":
            error = RequestFailedError(message[2])
            for rid in message[1]:
                live = self._forget(replica, rid)
                self._where.pop(rid, None)
                if live is not None:
                    live.stream._put(error)

    def _deliver(self, replica: Replica, out: RequestOutput) -> None:
        live = replica.live.get(out.request_id)
        if live is None:
            return  # aborted meanwhile
        out.prompt_token_ids, out.prompt = live.prompt_token_ids, live.prompt
        if out.finished:
            self._forget(replica, out.request_id)
            self._where.pop(out.request_id, None)
            if out.outputs and out.outputs[0].finish_reason in ("stop", "length"):
                # the replica caches the output's full blocks too: a later turn of the chat hits them
                self.affinity.record(replica.index, self.affinity.extend(
                    live.keys, live.prompt_token_ids + list(out.outputs[0].token_ids)))
        live.stream._put(out)

    def _update_metrics(self, replica: Replica, outputs: list[RequestOutput], total: SimpleNamespace) -> None:
        if self.metrics is not None:
            now = time.time()
            for out in outputs:
                self.metrics.observe_output(out, now)
            self.metrics.update_from_stats(total)
        self.replica_metrics.update(replica.index, replica.stats)

    def _total_stats(self) -> SimpleNamespace:
        """The replicas' EngineStats as one engine's: every counter and gauge summed, KV usage
        weighted by blocks, acceptance by position added up, the longest graph capture."""
        from specserve.engine import EngineStats

        stats = [r.stats for r in self.replicas if r.stats is not None]
        total = SimpleNamespace()
        for f in dataclasses.fields(EngineStats):
            values = [getattr(s, f.name) for s in stats]
            if f.type in ("int", int):
                setattr(total, f.name, sum(values))
        total.cuda_graph_capture_seconds = max((s.cuda_graph_capture_seconds for s in stats), default=0.0)
        blocks = total.num_total_blocks
        total.kv_cache_usage = (sum(s.kv_cache_usage * s.num_total_blocks for s in stats) / blocks
                                if blocks else 0.0)
        per_pos: list[int] = []
        for s in stats:
            for i, v in enumerate(s.spec_accepted_per_pos):
                if i == len(per_pos):
                    per_pos.append(0)
                per_pos[i] += v
        total.spec_accepted_per_pos = per_pos
        return total

    def _snapshot(self, total: SimpleNamespace) -> dict[str, Any]:
        return {"num_free_blocks": total.num_free_blocks,
                "num_total_blocks": total.num_total_blocks,
                "kv_cache_usage": total.kv_cache_usage, "num_running": total.num_running,
                "num_waiting": total.num_waiting,
                "replicas": [{"replica": r.index, "pid": r.facts.get("pid"), "alive": not r.dead,
                              "in_flight": len(r.live),
                              "num_free_blocks": getattr(r.stats, "num_free_blocks", None),
                              "num_total_blocks": getattr(r.stats, "num_total_blocks", None),
                              "kv_cache_usage": getattr(r.stats, "kv_cache_usage", None)}
                             for r in self.replicas]}

    def _on_exit(self, replica: Replica) -> None:
        """The replica's pipe closed: expected while stopping, else it died."""
        if self._stopping or replica.dead:
            return
        replica.dead = True
        code = replica.process.exitcode
        how = (f"killed by signal {-code}" if code is not None and code < 0
               else f"exit code {code}" if code is not None else "its pipe closed")
        logger.critical("replica %d (pid %s) died (%s); failing its %d request(s)", replica.index,
                        replica.facts.get("pid"), how, len(replica.live))
        self.error = RuntimeError(f"replica {replica.index} died ({how})")
        self.replica_metrics.set_up(replica.index, False)
        self.affinity.clear(replica.index)
        dead = EngineDeadError("the engine stopped; the server is restarting")
        for rid, live in list(replica.live.items()):
            self._where.pop(rid, None)
            if live.accepted:
                live.stream._put(dead)
            else:
                live.stream._on_added(dead)
        replica.live.clear()
        replica.prompt_tokens_in_flight = 0
        self.kv_snapshot = self._snapshot(self._total_stats())
        if self.on_death is not None:
            self.on_death(self.error)
