"""Tensor-parallel start-up and the worker loop (the sharding itself: model/parallel.py).

Rank 0 is the engine's process: scheduler, sampler, speculation and server. `start_runner`
spawns ranks 1..N-1 (multiprocessing spawn), each joined to rank 0 by a pipe:

  1. every worker imports and says hello; then every rank joins the process group (gloo on a
     CPU, NCCL on CUDA; its rendezvous a FileStore in a temporary directory);
  2. every rank builds the same ModelRunner and keeps its slice of the weights and its KV
     heads' cache; each worker says ready, or sends its error (rank 0 raises it);
  3. per step rank 0 sends one message, pickled once and written to every pipe: ("forward",
     the step's inputs: token ids, positions, context and query lengths, block tables, tree
     parents, rows to sample) or ("move_kv", source and destination slots of accepted
     drafts). Each worker runs the same runner method, so every rank issues the same
     collectives in the same order; rank 0 alone gets the whole logits.

Workers wait for the next message on their pipe, not inside a collective: an idle engine has
no collective timeout to meet, and a worker sees the engine's process end as its pipe closing
(it exits). On rank 0 a watchdog thread waits on the workers' process sentinels: once a worker
has died, or a collective has failed (gloo reports a closed connection at once, a hung rank
after parallel.COLLECTIVE_TIMEOUT_S), every later call raises parallel.WorkerLost and the
other workers are killed.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from specserve.config import CacheConfig, ModelConfig
from specserve.model.arch import ModelArch
from specserve.model.parallel import TensorParallel, WorkerLost, check_shape
from specserve.model.runner import ModelRunner, pick_device

logger = logging.getLogger(__name__)


def start_runner(model_dir: Path, arch: ModelArch, model_config: ModelConfig, cache_config: CacheConfig,
                 max_model_len: int, keep_vocab: bool = False) -> ModelRunner:
    """Rank 0's ModelRunner of a group of model_config.tensor_parallel_size ranks, with its
    workers started and ready. `keep_vocab`: a draft head will read the whole embedding and
    LM head (parallel.HeadView)."""
    size = model_config.tensor_parallel_size
    check_shape(arch.num_heads, arch.num_kv_heads, arch.intermediate_size, size)
    device = pick_device(model_config.device)
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size: {size} ranks need {size} GPUs, this machine has "
                         f"{torch.cuda.device_count()}")
    threads = torch.get_num_threads()
    if device.type == "cpu":  # the cores are split between the ranks
        torch.set_num_threads(max(1, threads // size))
    workers = Workers(size, threads)
    try:
        workers.spawn(model_dir, arch, model_config, cache_config, max_model_len, str(device))
        workers.wait_for("hello")
        tp = TensorParallel(0, size, workers.store_path, torch.device(device.type, 0)
                            if device.type == "cuda" else device, arch.vocab_size)
        tp.keep_vocab = keep_vocab
        runner = ModelRunner(model_dir, arch, model_config, cache_config, max_model_len, tp=tp)
        workers.wait_for("ready")
    except BaseException:
        workers.shutdown(kill=True)
        raise
    tp.workers = workers
    workers.start_watchdog()
    atexit.register(workers.shutdown)  # before multiprocessing's own exit handler kills them
    logger.info("tensor parallelism: %d ranks (%s), workers %s", size, "nccl" if device.type == "cuda" else "gloo",
                ", ".join(str(p.pid) for p in workers.procs))
    return runner


class Workers:
    """Rank 0's handle on ranks 1..N-1: their processes and pipes, the watchdog, shutdown."""

    def __init__(self, size: int, threads_before: int) -> None:
        self.size = size
        self.procs: list = []
        self.conns: list = []
        self._tmp = tempfile.mkdtemp(prefix="specserve-tp-")
        self.store_path = os.path.join(self._tmp, "store")
        self._threads_before = threads_before
        self._errors: dict[int, str] = {}  # rank -> the error it sent
        self.dead: str | None = None  # set by the watchdog: which worker ended, and how
        self.failure: str | None = None  # set once the group is lost
        self._closing = False
        self._lock = threading.Lock()  # the watchdog and the engine's thread both read the pipes

    def spawn(self, model_dir, arch, model_config, cache_config, max_model_len, device: str) -> None:
        ctx = mp.get_context("spawn")
        for rank in range(1, self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"specserve-tp-rank{rank}", daemon=True,
                               args=(rank, self.size, self.store_path, child, device, model_dir, arch,
                                     model_config, cache_config, max_model_len,
                                     max(1, self._threads_before // self.size)))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def wait_for(self, what: str) -> None:
        """Until every worker has said `what`; RuntimeError if one fails or exits first."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1):
            while True:
                if conn.poll(0.1):
                    try:
                        kind, detail = conn.recv()
                    except (EOFError, OSError):
                        kind, detail = "error", None
                    if kind == what:
                        break
                    if kind == "error":
                        proc.join(5)
                        raise RuntimeError(f"tensor-parallel worker {rank} failed to start "
                                           f"({self._describe(rank)}):\n{detail or ''}")
                elif not proc.is_alive():
                    raise RuntimeError(f"tensor-parallel worker {rank} failed to start ({self._describe(rank)})")

    def start_watchdog(self) -> None:
        threading.Thread(target=self._watch, name="specserve-tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, 1)}
        ended = multiprocessing.connection.wait(list(sentinels))
        if not self._closing:
            rank = sentinels[ended[0]]
            self.dead = f"tensor-parallel worker {rank} {self._describe(rank)}"
            logger.error("%s", self.dead)

    def _describe(self, rank: int) -> str:
        """How worker `rank` is, with the error it sent if it sent one."""
        with self._lock:
            return self._describe_locked(rank)

    def _describe_locked(self, rank: int) -> str:
        proc = self.procs[rank - 1]
        code = proc.exitcode
        if code is None:
            state = f"(pid {proc.pid}) is running"
        elif code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            state = f"(pid {proc.pid}) was killed by {name}"
        else:
            state = f"(pid {proc.pid}) exited with code {code}"
        conn = self.conns[rank - 1]
        try:
            while rank not in self._errors and conn.poll():
                kind, detail = conn.recv()
                if kind == "error":
                    self._errors[rank] = detail.strip().splitlines()[-1]
        except (EOFError, OSError):
            pass
        return state + (f": {self._errors[rank]}" if rank in self._errors else "")

    # -- the engine's thread ---------------------------------------------------------------------
    def check(self) -> None:
        if self.failure is not None:
            raise WorkerLost(self.failure)
        if self.dead is not None:
            raise self.lost(self.dead)

    def lost(self, reason: str) -> WorkerLost:
        """The group cannot go on: kill the workers; WorkerLost to raise (and every later call)."""
        if self.failure is None:
            deadline = time.monotonic() + 1.0  # a collective may fail before the dead one is reaped
            while all(p.exitcode is None for p in self.procs) and time.monotonic() < deadline:
                time.sleep(0.02)
            ended = [f"tensor-parallel worker {rank} {self._describe(rank)}"
                     for rank, p in enumerate(self.procs, 1) if p.exitcode is not None]
            self.failure = (f"tensor parallelism lost: {'; '.join(ended) if ended else reason}"
                            f"{'' if not ended or reason == ended[0] else f' ({reason})'}")
            logger.error("%s; the engine stops", self.failure)
            self.shutdown(kill=True)
        return WorkerLost(self.failure)

    def send(self, op: str, args: tuple) -> None:
        self.check()
        data = pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError as e:
                raise self.lost(f"a worker's pipe closed ({e})") from e

    def shutdown(self, kill: bool = False) -> None:
        """Stop every worker (kill: at once), and give the engine's process its threads back."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        for conn in self.conns:
            try:
                if not kill:
                    conn.send_bytes(pickle.dumps(("stop", ())))
            except OSError:
                pass
        for proc in self.procs:
            if not kill:
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        if torch.get_num_threads() != self._threads_before:
            torch.set_num_threads(self._threads_before)


def worker_main(rank: int, size: int, store_path: str, conn, device: str, model_dir, arch: ModelArch,
                model_config: ModelConfig, cache_config: CacheConfig, max_model_len: int, threads: int) -> None:
    """Rank `rank`: build the runner's slice, then run every step rank 0 sends until it says
    stop or its pipe closes. Any error ends the process (non-zero) after sending it to rank 0."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", rank)
            torch.cuda.set_device(dev)
        else:
            torch.set_num_threads(threads)
        conn.send(("hello", None))
        tp = TensorParallel(rank, size, store_path, dev, arch.vocab_size)
        runner = ModelRunner(model_dir, arch, model_config, cache_config, max_model_len, tp=tp)
        conn.send(("ready", None))
        steps = {"forward": runner.forward, "move_kv": runner._move_kv}
        while True:
            try:
                op, args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the engine's process is gone
                break
            if op == "stop":
                break
            steps[op](*args)
    except BaseException:  # noqa: BLE001 - whatever it was, rank 0 must hear of it
        text = traceback.format_exc()
        try:
            conn.send(("error", text))
        except OSError:
            pass
        sys.stderr.write(f"[specserve] tensor-parallel worker {rank} failed:\n{text}")
        sys.stderr.flush()
        os._exit(1)
