"""specserve against llama.cpp's server on the same model and prompts, side by side in one run.

    python benchmarks/llama_cpp.py --build       # once: builds llama-server (10-15 minutes on 2 cores)
    python benchmarks/llama_cpp.py [--concurrency 1 8] [--requests 8] [--max-tokens 96]
        [--dtype auto] [--quantization none int8] [--engine NAME=SPECULATIVE_CONFIG ...]
        [--repeats 1] [--out DIR]

`--build` downloads the source package of llama-cpp-python from PyPI, builds the server target
of its vendored llama.cpp (CPU, native instructions, static) and keeps the binary under
$SPECSERVE_CACHE_DIR/llama.cpp/ (default ~/.cache/specserve). Without that binary (or one given
by --llama-server) the benchmark prints how to get it and exits 0; `--no-llama-cpp` runs the
specserve servers alone, each against the first one (plain decoding, by default: speculation
through the server against none).

Both servers get the same GGUF (the default model's, Q4_1: llama.cpp reads it as it is,
specserve dequantizes it, to float32/bfloat16 or, with --quantization int8, to int8 with
one scale per row), the same threads (every core), the same held-out chat and code
prompts of `specserve bench load` through /v1/chat/completions, greedy, the same max_tokens.
One server runs at a time, alternating per repeat; at each concurrency c, the request list is
run closed-loop with c in flight. Reported: completion tokens per second (from each reply's
usage) and each engine's ratio to llama.cpp; a table, JSON and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.bench.load import load_prompts, machine  # noqa: E402
from specserve.bench.spec import grouped_bars  # noqa: E402
from specserve.config import DEFAULT_MODEL, QUANTIZATION_CHOICES  # noqa: E402
from specserve.env import cache_root  # noqa: E402
from specserve.model.loader import alias_gguf, canonical_alias  # noqa: E402

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # the source package whose vendor/llama.cpp is built


def server_path() -> Path:
    return cache_root() / "llama.cpp" / "llama-server"


def build(requirement: str = LLAMA_CPP_PYTHON, cmake_args: tuple[str, ...] = ()) -> Path:
    """Download `requirement`'s source package, build llama-server from its vendor/llama.cpp."""
    dest = server_path()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"downloading the source of {requirement} ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        requirement.split("==")[0], requirement, "-d", tmp], check=True, stdout=subprocess.DEVNULL)
        sdist = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("*/vendor/llama.cpp"))
        build_dir = Path(tmp) / "build"
        print(f"configuring {src.relative_to(tmp)} ...", flush=True)
        subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                        "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
                        *cmake_args],
                       check=True, stdout=subprocess.DEVNULL)
        print(f"building llama-server on {os.cpu_count()} cores (several minutes) ...", flush=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server",
                        "-j", str(os.cpu_count() or 1)], check=True, stdout=subprocess.DEVNULL)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(build_dir / "bin" / "llama-server", dest)
    print(f"built {dest}", flush=True)
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a loopback port, up once /health answers 200."""

    def __init__(self, name: str, argv: list[str], port: int) -> None:
        self.name, self.argv, self.port = name, argv, port
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile()

    def __enter__(self) -> "Server":
        import httpx

        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n"
                                   + self.log.read().decode(errors="replace")[-2000:])
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not come up in 10 minutes")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def closed_loop(port: int, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[int, float]:
    """Every prompt once, `concurrency` in flight, after one untimed warm-up request:
    (completion tokens, seconds)."""
    import httpx

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=1800) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def chat(prompt: str) -> int:
            body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens, "temperature": 0.0}
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        queue = list(reversed(prompts))

        async def worker() -> int:
            done = 0
            while queue:
                done += await chat(queue.pop())
            return done

        await chat(prompts[0])
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(worker() for _ in range(concurrency))))
        return tokens, time.perf_counter() - start


def engines(args: argparse.Namespace, gguf: Path, binary: Path) -> list[tuple[str, list[str]]]:
    """(name, argv with {port}) of every server, llama.cpp first."""
    threads = str(os.cpu_count() or 1)
    ctx = str(args.max_model_len * max(args.concurrency))
    out = [("llama.cpp", [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}",
                          "-t", threads, "-tb", threads, "--parallel", str(max(args.concurrency)), "-c", ctx])]
    for quantization in args.quantization:
        for spec in args.engine:
            name, _, config = spec.partition("=")
            out.append((name + ("" if quantization == "none" else f" {quantization}"), [
                sys.executable, "-m", "specserve.cli", "serve", "--port", "{port}", "--dtype", args.dtype,
                "--quantization", quantization, "--max-model-len", str(args.max_model_len),
                "--speculative-config", config or "auto", "--log-level", "warning", "--no-access-log"]))
    return out


def run(args: argparse.Namespace) -> int:
    if args.build:
        build(cmake_args=tuple(args.cmake_arg))
        return 0
    binary = Path(args.llama_server) if args.llama_server else server_path()
    if not args.no_llama_cpp and not binary.is_file():
        print(f"llama-server not found at {binary}: build it once with "
              "`python benchmarks/llama_cpp.py --build` (or pass --llama-server); skipping")
        return 0
    alias = canonical_alias(args.model)
    if alias is None:
        print(f"--model {args.model}: llama.cpp needs a GGUF; only the aliased models carry one")
        return 2
    gguf = alias_gguf(alias)
    prompts = [r["prompt"] for r in load_prompts("heldout")]
    servers = engines(args, gguf, binary)
    if args.no_llama_cpp:
        servers = servers[1:]
    results: dict[str, dict[int, list[float]]] = {name: {c: [] for c in args.concurrency} for name, _ in servers}
    for rep in range(args.repeats):
        order = servers if rep % 2 == 0 else servers[1:] + servers[:1]
        for name, argv in order:
            port = free_port()
            print(f"[repeat {rep + 1}/{args.repeats}] starting {name} ...", flush=True)
            with Server(name, [a.replace("{port}", str(port)) for a in argv], port):
                for c in args.concurrency:
                    n = max(args.requests, c)
                    todo = [prompts[i % len(prompts)] for i in range(n)]
                    tokens, seconds = asyncio.run(closed_loop(port, todo, c, args.max_tokens))
                    results[name][c].append(tokens / seconds)
                    print(f"  {name:<14} c={c:<3} {tokens} tokens in {seconds:.1f} s: "
                          f"{tokens / seconds:.1f} tok/s", flush=True)
    summary = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "model": args.model,
               "gguf": gguf.name, "reference": servers[0][0],
               "options": {k: v for k, v in vars(args).items() if k != "build"},
               "tok_per_s": {name: {c: statistics.median(v) for c, v in by_c.items()}
                             for name, by_c in results.items()}}
    print(table(summary, args.concurrency))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "llama_cpp.json").write_text(json.dumps(summary, indent=2))
    plot(summary, args.concurrency, out / "llama_cpp.png")
    print(f"wrote {out / 'llama_cpp.json'} and {out / 'llama_cpp.png'}")
    return 0


def table(summary: dict, levels: list[int]) -> str:
    rates, name_ref = summary["tok_per_s"], summary.get("reference", "llama.cpp")
    ref = rates[name_ref]
    lines = ["engine          " + "".join(f"   c={c:<3} tok/s  vs {name_ref:<9}" for c in levels)]
    for name, by_c in rates.items():
        lines.append(f"{name:<16}" + "".join(f"   {by_c[c]:>11.1f}  {by_c[c] / ref[c]:>11.2f}x" for c in levels))
    return "\n".join(lines)


def plot(summary: dict, levels: list[int], path: Path) -> None:
    series = {name: [by_c[c] for c in levels] for name, by_c in summary["tok_per_s"].items()}
    grouped_bars(path, [f"{c} concurrent" for c in levels], series, "completion tokens / s",
                 f"{summary['model']} ({summary['gguf']}), {summary['machine']['cpu_count']} cores")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", action="store_true", help="build llama-server (PyPI source, cmake) and exit")
    p.add_argument("--cmake-arg", action="append", default=[],
                   help="with --build: an extra cmake option (repeatable), e.g. -DGGML_NATIVE=OFF "
                        "-DGGML_AVX512=ON where the native build does not run")
    p.add_argument("--llama-server", default=None, help="a llama-server binary (default: the built one)")
    p.add_argument("--no-llama-cpp", action="store_true",
                   help="the specserve servers alone, each against the first --engine")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto", help="specserve's --dtype")
    p.add_argument("--quantization", nargs="+", default=["none", "int8"], choices=list(QUANTIZATION_CHOICES),
                   help="run every --engine with each of these target weight formats")
    p.add_argument("--engine", action="append", default=None, metavar="NAME=SPECULATIVE_CONFIG",
                   help="a specserve server to run (repeatable; default: plain=none and default=auto)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests", type=int, default=8, help="requests per level (at least the concurrency)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1, help="rounds; the median is reported")
    p.add_argument("--out", default="bench_out/llama_cpp")
    args = p.parse_args(argv)
    args.engine = args.engine or ["plain=none", "default=auto"]
    if min(args.concurrency) < 1 or args.requests < 1 or args.max_tokens < 1 or args.repeats < 1:
        p.error("--concurrency, --requests, --max-tokens and --repeats must be at least 1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
