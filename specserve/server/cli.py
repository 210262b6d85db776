"""`specserve serve` / `python -m specserve.server`: flags, engine construction, uvicorn.

Shutdown: on SIGTERM (or SIGINT) the server stops accepting connections, answers new requests
on open ones with 503, and lets running requests finish for up to --shutdown-timeout seconds;
streams still running then end with an error event and [DONE], non-streaming calls with a 503.
The app's lifespan then stops the engine thread and the process exits 0. If the engine thread
dies, the server shuts down the same way and exits 1, so that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
from typing import Any

from specserve.config import DEFAULT_MODEL, DTYPE_CHOICES, QUANTIZATION_CHOICES, EngineConfig
from specserve.env import env_str
from specserve.server.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS

logger = logging.getLogger("specserve.server")


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help=f"model name or Hugging Face model directory (default {DEFAULT_MODEL})")
    g.add_argument("--served-model-name", default=None,
                   help="name clients use in `model` (default: the engine's model name)")
    g.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES),
                   help="auto: bfloat16 on CUDA; on a CPU float32 where specserve's C kernels run (x86 "
                        "with AVX2), else bfloat16 where the CPU has it natively, else float32")
    g.add_argument("--quantization", "-q", default="none", choices=list(QUANTIZATION_CHOICES),
                   help="int8: the target's weights in int8 (one scale per output row) on the CPU, "
                        "through a batch-invariant AVX2 kernel: a quarter of float32's weight "
                        "bytes, output close to (not identical with) the unquantized model's. "
                        "gguf: every product with int8 activations against the GGUF's Q4_1 / Q8_0 "
                        "blocks, as GGUF runtimes multiply (CPU, float32): faster, verify rows "
                        "about a third of float32's cost; output close to (not identical with) "
                        "the float32 model's")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly: no compiled step and no CUDA graphs (on CUDA "
                        "both are on by default; a CPU runs eagerly anyway)")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="every row computed with the bits it gets alone, so that speculation is "
                        "exactly lossless: on CUDA every product, norm and elementwise step through "
                        "our batch-invariant Triton kernels (cuBLAS picks its kernels by row count); "
                        "on a CPU PyTorch's products in calls of at most the rows that keep a row's "
                        "bits, measured at start (oneDNN picks its kernels by row count too). On by "
                        "default in bfloat16/float16, off in float32, where a CPU's C kernels are "
                        "batch-invariant already (its cost: docs/benchmarks.md)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false")
    g.add_argument("--speculative-config", default="auto",
                   help='JSON as in vLLM, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'; '
                        'default "auto": EAGLE with the shipped head on the default model, prompt '
                        'lookup on others, verified only where the measured cost model says it '
                        'pays; "none" turns speculation off')
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="N engine processes (replicas) behind the one server, each with the "
                        "whole model and its own KV cache; requests go to the replica holding "
                        "the longest cached prefix of the prompt, else to the least loaded. On "
                        "a CPU the torch threads are split evenly between replicas")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model across N ranks (processes; on CUDA one GPU each): "
                        "attention heads, KV cache, MLP and vocabulary divided between them; gloo "
                        "on a CPU, NCCL on CUDA (untested on GPUs). The heads must divide by N")
    g.add_argument("--tool-call-parser", default=DEFAULT_TOOL_PARSER, choices=list(TOOL_PARSERS),
                   help="the model's tool-call format: smollm (the default model's), hermes "
                        "(Hermes 2 Pro, Qwen 2.5/3), llama3_json (Llama 3.1+); docs/server.md")

    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-request-body-bytes", type=int, default=16 << 20,
                   help="larger request bodies get HTTP 413 (default 16 MiB)")
    s.add_argument("--api-key", action="append", default=None,
                   help="require `Authorization: Bearer KEY` on every route but /health "
                        "(default: $SPECSERVE_API_KEY if set); repeat it for several tenants: "
                        "suffix decoding drafts only from the same key's outputs")
    s.add_argument("--require-api-key", action="store_true",
                   help="refuse to start on an address other than loopback without an API key "
                        "(the container image sets it)")
    s.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics without the API key (for a Prometheus that sends none)")
    s.add_argument("--max-queued-requests", type=int, default=1024,
                   help="sequences (prompts x n) that may wait beyond --max-num-seqs; past "
                        "that, requests get HTTP 429 with Retry-After")
    s.add_argument("--request-timeout", type=float, default=None,
                   help="end any request that runs longer than this many seconds (HTTP 408, "
                        "or an error event in a stream); default: no limit")
    s.add_argument("--health-stall-timeout", type=float, default=60.0,
                   help="/health turns 503 when the engine completes no step for this many "
                        "seconds")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds to let running requests finish after SIGTERM; those still "
                        "running then end with an error event")
    s.add_argument("--timeout-keep-alive", type=float, default=75.0,
                   help="seconds an idle HTTP connection stays open for its next request; "
                        "longer than the idle time after which clients and proxies drop a "
                        "pooled connection (httpx, the openai client: 5 s; load balancers: "
                        "60 s), so that a client never sends on a connection the server is "
                        "closing")
    s.add_argument("--timeout-request-head", type=float, default=60.0,
                   help="seconds a client has to send a request's line and headers once its "
                        "connection opens (or its next request begins); slower connections "
                        "are closed, so that idle or half-sent ones cannot hold the server's "
                        "sockets")
    s.add_argument("--timeout-request-body", type=float, default=60.0,
                   help="seconds a client has to send a request's whole body once its head "
                        "arrived; slower connections are closed, so that bodies sent a few "
                        "bytes at a time cannot hold the server's sockets")
    s.add_argument("--max-connections-per-client", type=int, default=None, metavar="N",
                   help="open connections one client address may hold; past that a new one is "
                        "answered with HTTP 429 and closed, so that one client cannot take the "
                        "sockets every other needs (0: no cap; behind a proxy, whose address "
                        "every connection has, size it for the proxy); default: a quarter of "
                        "the process's open-file limit")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--no-access-log", dest="access_log", action="store_false")
    s.add_argument("--stats-interval", type=float, default=5.0,
                   help="seconds between stats log lines while busy")
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.create(
        args.model, dtype=args.dtype, load_format=args.load_format,
        max_model_len=args.max_model_len, device=args.device, seed=args.seed,
        block_size=args.block_size, num_blocks=args.num_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        enable_prefix_caching=args.enable_prefix_caching, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        speculative_config=args.speculative_config, quantization=args.quantization,
        enforce_eager=getattr(args, "enforce_eager", False),
        batch_invariant=getattr(args, "batch_invariant", None),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1))


def run_server(args: argparse.Namespace, engine: Any = None) -> int:
    """Build the engine (unless given), serve until SIGTERM/SIGINT; returns the exit code."""
    import uvicorn

    from specserve.metrics import ServerMetrics, StatsLogger
    from specserve.server.app import build_app
    from specserve.server.async_engine import AsyncEngine, engine_executor
    from specserve.server.connections import default_max_per_client, http_protocol

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or ([env_str("API_KEY")] if env_str("API_KEY") else None)
    if args.require_api_key and not api_key and not _is_loopback(args.host):
        print(f"specserve serve: refusing to serve on {args.host} without an API key: set "
              "SPECSERVE_API_KEY (or --api-key), or bind to 127.0.0.1", file=sys.stderr)
        return 2
    for flag in ("timeout_keep_alive", "timeout_request_head", "timeout_request_body"):
        if not getattr(args, flag) > 0:
            print(f"specserve serve: --{flag.replace('_', '-')} must be more than 0 seconds",
                  file=sys.stderr)
            return 2
    if args.max_connections_per_client is not None and args.max_connections_per_client < 0:
        print("specserve serve: --max-connections-per-client must be 0 (no cap) or more",
              file=sys.stderr)
        return 2
    per_client = (default_max_per_client() if args.max_connections_per_client is None
                  else args.max_connections_per_client)
    executor = engine_executor()  # builds the engine and steps it: one thread for model work
    num_replicas = getattr(args, "data_parallel_size", 1)
    replicas = None
    if num_replicas < 1:
        print("specserve serve: --data-parallel-size must be at least 1", file=sys.stderr)
        return 2
    if num_replicas > 1 and engine is not None:
        raise ValueError("run_server: replicas build their own engines; pass no engine")
    if engine is None:
        try:
            config = engine_config_from_args(args)
        except ValueError as e:
            print(f"specserve serve: {e}", file=sys.stderr)
            return 2
        if num_replicas > 1:  # engine processes behind this one (server/replicas.py)
            from specserve.server.replicas import (ReplicaEngineView, ReplicaStartError,
                                                   launch_replicas)
            try:
                replicas = launch_replicas(config, num_replicas, args.stats_interval,
                                           args.log_level)
            except ReplicaStartError as e:
                print(f"specserve serve: {e}", file=sys.stderr)
                return 1
            engine = ReplicaEngineView(replicas[0].facts)
        else:
            from specserve.engine import Engine
            try:
                engine = executor.submit(Engine, config).result()
            except ValueError as e:  # a configuration the model cannot take (e.g. heads that -tp does not divide)
                print(f"specserve serve: {e}", file=sys.stderr)
                return 2

    name = args.served_model_name or engine.model_name
    aliases = [a for a in (engine.model_name, args.model) if a and a != name]
    metrics = ServerMetrics(name)
    if replicas is not None:
        from specserve.server.replicas import ReplicaRouter
        async_engine: AsyncEngine = ReplicaRouter(
            replicas, metrics, max_in_flight=num_replicas * args.max_num_seqs + args.max_queued_requests,
            request_timeout=args.request_timeout, stall_timeout=args.health_stall_timeout,
            max_num_seqs=args.max_num_seqs, engine_view=engine)
    else:
        async_engine = AsyncEngine(engine, metrics, StatsLogger(args.stats_interval), executor,
                                   max_in_flight=args.max_num_seqs + args.max_queued_requests,
                                   request_timeout=args.request_timeout,
                                   stall_timeout=args.health_stall_timeout)
    app = build_app(async_engine, name, api_key=api_key, aliases=aliases,
                    max_body_bytes=args.max_request_body_bytes,
                    tool_call_parser=args.tool_call_parser, public_metrics=args.public_metrics)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            # no new requests from here; streams still running at the deadline end with an
            # error event and [DONE] (uvicorn's own deadline, a little later, is a backstop)
            async_engine.begin_shutdown(args.shutdown_timeout)
            await super().shutdown(sockets)

    server = Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        access_log=args.access_log, timeout_graceful_shutdown=args.shutdown_timeout + 5,
        timeout_keep_alive=args.timeout_keep_alive,
        http=http_protocol(args.timeout_request_head, args.timeout_request_body, per_client)))

    def engine_died(error: BaseException) -> None:
        logger.critical("the engine died (%r): exiting so that a supervisor restarts the "
                        "server", error)
        server.should_exit = True

    async_engine.on_death = engine_died

    # uvicorn re-raises the signal that stopped it once it is done; with this handler in
    # place a graceful SIGTERM ends in a normal return (exit 0) instead of a kill.
    stopped_by: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: stopped_by.append(sig))
    try:
        logger.info("serving %s on http://%s:%d (max_model_len %s)", name, args.host,
                    args.port, getattr(engine, "max_model_len", "?"))
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        stopped = async_engine.stop()
    code = 1 if async_engine.error is not None or not server.started else 0
    if not stopped:  # a step that does not end: the engine thread would keep the process alive
        logger.error("the engine thread did not stop; exiting anyway")
        logging.shutdown()
        os._exit(code or 1)
    logger.info("server stopped")
    return code


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve serve",
                                     description="OpenAI-compatible server for specserve")
    add_serve_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_server(args)
    except KeyboardInterrupt:
        return 130
