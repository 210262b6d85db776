"""`specserve bench serve`: load a running OpenAI-compatible server and measure latency.

Sends N streaming requests, all at once or with Poisson arrivals at --request-rate, and
measures per request: TTFT (time to the first content), inter-token latency (gaps between
content chunks, each gap split evenly over the tokens it carried), end-to-end latency and
output tokens (from the usage chunk). Prints a table, and optionally writes JSON and a PNG.

It talks HTTP only (httpx), so it works against any OpenAI-compatible server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "List five fruits and their colors.",
    "What is speculative decoding in language models?",
    "Describe a cat to someone who has never seen one.",
    "Give three tips for writing clean Python code.",
    "Summarize the plot of a heist movie in three sentences.",
    "Count from one to twenty in words.",
]


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server address (without /v1)")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (Poisson arrivals); inf sends all at once")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts-file", default=None,
                        help="a text file with one prompt per line (default: built-in prompts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--result-json", default=None, help="write the summary here")
    parser.add_argument("--plot", default=None, help="write a PNG of the latency distributions")
    return parser


async def _one(client: Any, url: str, body: dict[str, Any], chat: bool) -> RequestResult:
    start = time.perf_counter()
    first, last, tokens_seen = None, None, 0
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                for choice in chunk.get("choices", []):
                    text = (choice.get("delta") or {}).get("content") if chat \
                        else choice.get("text")
                    if not text:
                        continue
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    elif last is not None:
                        result.itls.append(now - last)
                    last = now
                    tokens_seen += 1
    except Exception as e:  # noqa: BLE001 - a failed request is a data point
        result.error = repr(e)
        return result
    end = time.perf_counter()
    result.ok = first is not None
    result.ttft = (first or end) - start
    result.e2e = end - start
    result.output_tokens = result.output_tokens or tokens_seen
    if result.itls and result.output_tokens > len(result.itls) + 1:
        # chunks carried several tokens (speculation): spread each gap over its tokens
        scale = (len(result.itls)) / (result.output_tokens - 1)
        result.itls = [g * scale for g in result.itls]
    return result


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(p: float) -> float:
        k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
        return ordered[k]

    return {"mean": statistics.fmean(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    prompts = DEFAULT_PROMPTS
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=max(args.num_prompts, 1) + 4)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits,
                                 timeout=args.timeout) as client:
        model = args.model
        if model is None:
            models = (await client.get("/v1/models")).json()
            model = models["data"][0]["id"]
        chat = args.endpoint == "chat"
        url = "/v1/chat/completions" if chat else "/v1/completions"
        tasks = []
        start = time.perf_counter()
        for i in range(args.num_prompts):
            prompt = prompts[i % len(prompts)]
            body: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens,
                                    "temperature": args.temperature, "stream": True,
                                    "stream_options": {"include_usage": True}}
            if chat:
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            tasks.append(asyncio.create_task(_one(client, url, body, chat)))
            if args.request_rate != float("inf") and i + 1 < args.num_prompts:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, args, model)


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace,
              model: str) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "model": model, "endpoint": args.endpoint, "num_prompts": len(results),
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "max_tokens": args.max_tokens, "duration_s": duration,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration if duration else 0,
        "requests_per_s": len(ok) / duration if duration else 0,
        "ttft_s": _percentiles([r.ttft for r in ok]),
        "itl_s": _percentiles([g for r in ok for g in r.itls]),
        "e2e_s": _percentiles([r.e2e for r in ok]),
        "raw": [asdict(r) | {"itls": None} for r in results],
        "_samples": {"ttft": [r.ttft for r in ok], "itl": [g for r in ok for g in r.itls],
                     "e2e": [r.e2e for r in ok]},
    }


def format_table(s: dict[str, Any]) -> str:
    lines = [f"model {s['model']}  endpoint {s['endpoint']}  prompts {s['num_prompts']}  "
             f"completed {s['completed']}  failed {s['failed']}",
             f"duration {s['duration_s']:.2f} s   output tokens {s['output_tokens']}   "
             f"throughput {s['output_tokens_per_s']:.1f} tok/s   {s['requests_per_s']:.2f} req/s",
             f"{'metric (ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "inter-token"), ("e2e_s", "end-to-end")):
        p = s[key]
        lines.append(f"{label:<16}" + "".join(f"{1000 * p[k]:>10.1f}"
                                              for k in ("mean", "p50", "p90", "p99")))
    for err in s["errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)


def plot(s: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = s["_samples"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = (("ttft", "time to first token"), ("itl", "inter-token latency"),
              ("e2e", "end-to-end"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        values = [1000 * v for v in samples[key]]
        if values:
            ax.hist(values, bins=min(40, max(5, len(values) // 2)))
        ax.set_title(title)
        ax.set_xlabel("ms")
    fig.suptitle(f"{s['model']}: {s['completed']} requests, "
                 f"{s['output_tokens_per_s']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    summary = asyncio.run(_run(args))
    print(format_table(summary))
    if args.plot:
        plot(summary, args.plot)
        print(f"plot written to {args.plot}")
    if args.result_json:
        with open(args.result_json, "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in summary.items() if not k.startswith("_")}, f, indent=2)
        print(f"results written to {args.result_json}")
    return 0 if summary["failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve bench serve", description=__doc__)
    return run(add_args(parser).parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
