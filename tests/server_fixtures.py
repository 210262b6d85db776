"""Helpers for the server tests: a real `python -m specserve.server` process on a loopback port.

Each test module starts one server (module-scoped fixture) and talks to it over HTTP, with the
official `openai` client or httpx. The process log goes to a file, shown when startup fails.
SPECSERVE_TEST_SERVER_ENTRY (a script path) replaces `-m specserve.server`, to try the tests
against another entry point, e.g. a stub engine.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT = float(os.environ.get("SPECSERVE_TEST_STARTUP_TIMEOUT", "600"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], api_key: str | None = None, wait: bool = True) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="specserve-server-", suffix=".log")[1])
        entry = os.environ.get("SPECSERVE_TEST_SERVER_ENTRY")
        cmd = [sys.executable] + ([entry] if entry else ["-m", "specserve.server"])
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--no-access-log"] + args
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(REPO))
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not start in {STARTUP_TIMEOUT}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai(self, **kwargs):
        import openai
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused",
                             max_retries=0, timeout=kwargs.pop("timeout", 120), **kwargs)

    def async_openai(self, **kwargs):
        import openai
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1",
                                  api_key=self.api_key or "unused", max_retries=0,
                                  timeout=kwargs.pop("timeout", 120), **kwargs)

    def metrics_text(self) -> str:
        return httpx.get(f"{self.base_url}/metrics", headers=self.headers, timeout=10).text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total, found = 0.0, False
        for line in self.metrics_text().splitlines():
            m = re.match(r"^([\w:]+)(\{[^}]*\})?\s+(\S+)$", line)
            if not m or m.group(1) != name:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(m.group(3))
                found = True
        if not found:
            raise KeyError(f"{name}{labels} not in /metrics")
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def start_servers(**args: list[str]) -> dict[str, ServerProcess]:
    """Servers started side by side (name -> its arguments), returned once all are ready: most of
    a start is single-threaded (imports, reading the weights), so two overlap on two cores."""
    procs = {name: ServerProcess(a, wait=False) for name, a in args.items()}
    try:
        for proc in procs.values():
            proc.wait_ready()
    except BaseException:
        for proc in procs.values():
            proc.stop()
        raise
    return procs


def default_model_args(max_model_len: int = 256) -> list[str]:
    """The real default model, a short context and enough sequences for the concurrency test."""
    return ["--max-model-len", str(max_model_len), "--max-num-seqs", "64",
            "--kv-cache-memory-gb", "0.25", "--stats-interval", "5"]


class BackgroundStream:
    """A streaming completion read on a thread of its own: `events` (the SSE data lines) grow
    as they come; `started` is set at the first. For tests that kill a process mid-stream."""

    def __init__(self, base_url: str, body: dict, timeout: float = 60) -> None:
        import threading

        self.events: list[str] = []
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(base_url, {**body, "stream": True}, timeout))
        self.thread.start()

    def _read(self, base_url: str, body: dict, timeout: float) -> None:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=timeout) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.started.set()

    def join(self, timeout: float) -> bool:
        """Whether the stream ended within `timeout` seconds."""
        self.thread.join(timeout)
        return not self.thread.is_alive()
