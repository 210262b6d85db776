"""Prometheus collectors for the server, and the periodic log line.

`ServerMetrics` owns a private CollectorRegistry (several servers may live in one process, as
in tests). It is fed from the engine thread only: `update_from_stats` after each engine step
(counters advance by the delta of the engine's cumulative counts) and `observe_output` for each
RequestOutput (latency histograms, finished requests). prometheus_client is thread-safe, so
`/metrics` may render from the event loop at any time.

`format_spec_log` and `StatsLogger` build the human-readable line; neither touches Prometheus,
so the offline engine can reuse them.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

logger = logging.getLogger("specserve.metrics")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0)

_COUNTER_FIELDS = ("prompt_tokens_total", "generation_tokens_total", "num_preemptions",
                   "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")
# the speculative decoder's choice for each step with requests to draft for: EngineStats field by
# the `kind` label of specserve:spec_decode_steps
_STEP_KINDS = {"drafting": "spec_steps_drafting", "lookup_only": "spec_steps_lookup_only",
               "plain": "spec_steps_plain"}

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """All collectors of one served model; every metric carries the model_name label."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry(auto_describe=True)
        reg, label = self.registry, ["model_name"]

        # prometheus_client adds "_total" to counter names itself: declare them without it.
        self.num_running = Gauge("specserve:num_requests_running",
                                 "Requests in the running batch.", label, registry=reg)
        self.num_waiting = Gauge("specserve:num_requests_waiting",
                                 "Requests waiting to be scheduled.", label, registry=reg)
        self.kv_usage = Gauge("specserve:kv_cache_usage_perc",
                              "Fraction of KV cache blocks in use (0 to 1).", label, registry=reg)
        self.graph_capture = Gauge("specserve:cuda_graph_capture_seconds",
                                   "Seconds the engine took at start to capture its CUDA graphs "
                                   "(0 without graphs).", label, registry=reg)
        self.prompt_tokens = Counter("specserve:prompt_tokens",
                                     "Prompt tokens processed.", label, registry=reg)
        self.generation_tokens = Counter("specserve:generation_tokens",
                                         "Tokens generated.", label, registry=reg)
        self.num_preemptions = Counter("specserve:num_preemptions",
                                       "Requests preempted (KV blocks freed, recomputed later).",
                                       label, registry=reg)
        self.request_success = Counter("specserve:request_success",
                                       "Finished requests by finish reason.",
                                       label + ["finished_reason"], registry=reg)
        self.ttft = Histogram("specserve:time_to_first_token_seconds",
                              "Time to first token.", label, buckets=_TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("specserve:inter_token_latency_seconds",
                             "Time between output tokens.", label, buckets=_ITL_BUCKETS,
                             registry=reg)
        self.e2e = Histogram("specserve:e2e_request_latency_seconds",
                             "Request latency from arrival to finish.", label,
                             buckets=_E2E_BUCKETS, registry=reg)
        self.spec_drafts = Counter("specserve:spec_decode_num_drafts",
                                   "Speculation rounds (drafts verified).", label, registry=reg)
        self.spec_draft_tokens = Counter("specserve:spec_decode_num_draft_tokens",
                                         "Draft tokens proposed.", label, registry=reg)
        self.spec_accepted_tokens = Counter("specserve:spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted.", label, registry=reg)
        self.spec_accepted_per_pos = Counter(
            "specserve:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.", label + ["position"],
            registry=reg)
        self.spec_steps = Counter(
            "specserve:spec_decode_steps",
            "Steps with requests to draft for, by what the speculative decoder chose: drafting "
            "(every proposer), lookup_only (prompt-lookup chains alone), plain (speculation "
            "measured slower at that batch size, or a plain step sampled for comparison).",
            label + ["kind"], registry=reg)

        self._last_counts = dict.fromkeys(_COUNTER_FIELDS + tuple(_STEP_KINDS.values()), 0)
        self._last_per_pos: list[int] = []
        self._last_token_time: dict[str, tuple[float, int]] = {}  # request id -> (time, tokens)
        # Create every child up front so all series exist (at 0) from the first scrape.
        for metric in (self.num_running, self.num_waiting, self.kv_usage, self.graph_capture, self.prompt_tokens,
                       self.generation_tokens, self.num_preemptions, self.ttft, self.itl, self.e2e,
                       self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens):
            metric.labels(self.model_name)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(self.model_name, reason)
        for kind in _STEP_KINDS:
            self.spec_steps.labels(self.model_name, kind)

    # -- feeding ----------------------------------------------------------------------
    def update_from_stats(self, stats: Any) -> None:
        """Gauges take the engine's current values; counters advance by the delta."""
        name = self.model_name
        self.num_running.labels(name).set(stats.num_running)
        self.num_waiting.labels(name).set(stats.num_waiting)
        usage = float(stats.kv_cache_usage)
        self.kv_usage.labels(name).set(min(max(usage, 0.0), 1.0))
        self.graph_capture.labels(name).set(float(getattr(stats, "cuda_graph_capture_seconds", 0.0) or 0.0))

        targets = {"prompt_tokens_total": self.prompt_tokens,
                   "generation_tokens_total": self.generation_tokens,
                   "num_preemptions": self.num_preemptions,
                   "spec_num_drafts": self.spec_drafts,
                   "spec_num_draft_tokens": self.spec_draft_tokens,
                   "spec_num_accepted_tokens": self.spec_accepted_tokens}
        children = [(field, counter.labels(name)) for field, counter in targets.items()]
        children += [(field, self.spec_steps.labels(name, kind)) for kind, field in _STEP_KINDS.items()]
        for field, child in children:
            value = int(getattr(stats, field, 0) or 0)
            delta = value - self._last_counts[field]
            if delta > 0:
                child.inc(delta)
            self._last_counts[field] = value

        per_pos = list(getattr(stats, "spec_accepted_per_pos", None) or [])
        for pos, value in enumerate(per_pos):
            last = self._last_per_pos[pos] if pos < len(self._last_per_pos) else 0
            child = self.spec_accepted_per_pos.labels(name, str(pos))
            if value > last:
                child.inc(value - last)
        self._last_per_pos = per_pos

    def observe_output(self, output: Any, now: float | None = None) -> None:
        """Latency histograms from one RequestOutput; counts the request when it finishes."""
        now = time.time() if now is None else now
        name = self.model_name
        rid = output.request_id
        reason = output.outputs[0].finish_reason if output.outputs else None
        if output.finished and reason == "abort":
            # An aborted request's last output says nothing about latency.
            self._last_token_time.pop(rid, None)
            self.request_success.labels(name, "abort").inc()
            return
        num_tokens = len(output.outputs[0].token_ids) if output.outputs else 0
        last = self._last_token_time.get(rid)
        if last is None:
            if num_tokens > 0:
                first = output.first_token_time or now
                self.ttft.labels(name).observe(max(first - output.arrival_time, 0.0))
                self._last_token_time[rid] = (first, num_tokens)
        elif num_tokens > last[1]:
            # Several tokens may land in one step (accepted drafts): spread the interval.
            new = num_tokens - last[1]
            gap = max(now - last[0], 0.0) / new
            for _ in range(new):
                self.itl.labels(name).observe(gap)
            self._last_token_time[rid] = (now, num_tokens)
        if output.finished:
            self._last_token_time.pop(rid, None)
            self.request_success.labels(name, reason or "stop").inc()
            end = output.finished_time or now
            self.e2e.labels(name).observe(max(end - output.arrival_time, 0.0))

    def forget(self, request_id: str) -> None:
        """Drop the timing state of a request that ended without a finished output."""
        self._last_token_time.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# -- the periodic log line ------------------------------------------------------------------

def format_spec_log(stats: Any, prev: Any = None) -> str:
    """Speculation summary from EngineStats-like cumulative counts (a window when prev given).

    Mean acceptance length counts the bonus token: 1 + accepted / drafts (vLLM's definition).
    Per-position rate: accepted at position i / drafts.
    """
    def delta(field: str) -> int:
        value = int(getattr(stats, field, 0) or 0)
        return value - (int(getattr(prev, field, 0) or 0) if prev is not None else 0)

    drafts = delta("spec_num_drafts")
    draft_tokens = delta("spec_num_draft_tokens")
    accepted = delta("spec_num_accepted_tokens")
    if drafts <= 0:
        return "spec decode: no drafts"
    per_pos = list(getattr(stats, "spec_accepted_per_pos", None) or [])
    prev_pos = list(getattr(prev, "spec_accepted_per_pos", None) or []) if prev is not None else []
    rates = [(v - (prev_pos[i] if i < len(prev_pos) else 0)) / drafts
             for i, v in enumerate(per_pos)]
    rate_text = ", ".join(f"{r:.3f}" for r in rates)
    draft_acc = accepted / draft_tokens if draft_tokens else 0.0
    return (f"spec decode: mean acceptance length {1 + accepted / drafts:.2f}, "
            f"accepted {accepted}/{draft_tokens} draft tokens ({100 * draft_acc:.1f}%), "
            f"drafts {drafts}, per-position acceptance rate [{rate_text}]")


class StatsLogger:
    """Logs throughput, queue sizes and KV usage every `interval` seconds while busy."""

    def __init__(self, interval: float = 5.0, log: logging.Logger | None = None) -> None:
        self.interval = interval
        self.log = log or logger
        self._last_time = time.monotonic()
        self._last: dict[str, Any] | None = None

    def maybe_log(self, stats: Any, force: bool = False) -> str | None:
        now = time.monotonic()
        if not force and now - self._last_time < self.interval:
            return None
        snap = _snapshot(stats)
        prev = self._last
        elapsed = max(now - self._last_time, 1e-9)
        self._last_time, self._last = now, snap
        busy = snap["num_running"] or snap["num_waiting"]
        moved = prev is not None and (
            snap["generation_tokens_total"] != prev["generation_tokens_total"])
        if not force and not busy and not moved:
            return None
        prompt_tps = (snap["prompt_tokens_total"]
                      - (prev or {}).get("prompt_tokens_total", 0)) / elapsed
        gen_tps = (snap["generation_tokens_total"]
                   - (prev or {}).get("generation_tokens_total", 0)) / elapsed
        line = (f"prompt throughput {prompt_tps:.1f} tok/s, generation throughput "
                f"{gen_tps:.1f} tok/s, running {snap['num_running']}, waiting "
                f"{snap['num_waiting']}, kv cache usage {100 * snap['kv_cache_usage']:.1f}%")
        if snap["spec_num_drafts"] - (prev or {}).get("spec_num_drafts", 0) > 0:
            line += "; " + format_spec_log(_Obj(snap), _Obj(prev) if prev else None)
        self.log.info(line)
        return line


_SNAP_FIELDS = ("num_running", "num_waiting", "kv_cache_usage") + _COUNTER_FIELDS


def _snapshot(stats: Any) -> dict[str, Any]:
    snap = {f: getattr(stats, f, 0) or 0 for f in _SNAP_FIELDS}
    snap["spec_accepted_per_pos"] = list(getattr(stats, "spec_accepted_per_pos", None) or [])
    return snap


class _Obj:
    def __init__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)


class SpecLog:
    """A log line with mean acceptance length and per-position rates since the last line,
    at most every `interval` seconds and only when something was verified."""

    def __init__(self, interval: float = 5.0) -> None:
        self.interval, self.last, self.prev = interval, time.monotonic(), None

    def maybe(self, stats: Any) -> None:
        now = time.monotonic()
        if now - self.last >= self.interval and \
                stats.spec_num_drafts != (self.prev.spec_num_drafts if self.prev else 0):
            logging.getLogger("specserve.spec_decode").info(format_spec_log(stats, self.prev))
            self.last, self.prev = now, copy.deepcopy(stats)



class ReplicaMetrics:
    """Per-replica series of a server with data-parallel replicas (server/replicas.py), each
    with the labels model_name and replica ("0", "1", ...). The unlabelled-by-replica series of
    ServerMetrics carry the totals over all replicas; these say how the work and the prefix
    cache split. Fed on the event loop from each replica's EngineStats and the router."""

    def __init__(self, model_name: str, num_replicas: int, registry: CollectorRegistry) -> None:
        self.model_name = model_name
        reg, label = registry, ["model_name", "replica"]
        self.up = Gauge("specserve:replica_up",
                        "1 while the replica's process runs, 0 once it has died.", label,
                        registry=reg)
        self.in_flight = Gauge("specserve:replica_requests_in_flight",
                               "Requests routed to the replica and not finished (the router's "
                               "load).", label, registry=reg)
        self.num_running = Gauge("specserve:replica_num_requests_running",
                                 "Requests in the replica's running batch.", label, registry=reg)
        self.num_waiting = Gauge("specserve:replica_num_requests_waiting",
                                 "Requests waiting in the replica's queue.", label, registry=reg)
        self.kv_usage = Gauge("specserve:replica_kv_cache_usage_perc",
                              "Fraction of the replica's KV cache blocks in use (0 to 1).",
                              label, registry=reg)
        self.prompt_tokens = Counter("specserve:replica_prompt_tokens",
                                     "Prompt tokens the replica processed.", label, registry=reg)
        self.generation_tokens = Counter("specserve:replica_generation_tokens",
                                         "Tokens the replica generated.", label, registry=reg)
        self.prefix_queries = Counter("specserve:replica_prefix_cache_queries",
                                      "Prompt tokens looked up in the replica's prefix cache.",
                                      label, registry=reg)
        self.prefix_hits = Counter("specserve:replica_prefix_cache_hits",
                                   "Prompt tokens found in the replica's prefix cache.", label,
                                   registry=reg)
        self.hit_rate = Gauge("specserve:replica_prefix_cache_hit_rate",
                              "Prefix cache hits / queries of the replica since it started.",
                              label, registry=reg)
        self.routed = Counter("specserve:replica_requests_routed",
                              "Requests routed to the replica, by reason: prefix (it held the "
                              "longest cached prefix) or load (the least loaded).",
                              label + ["reason"], registry=reg)
        self._fields = {"prompt_tokens_total": self.prompt_tokens,
                        "generation_tokens_total": self.generation_tokens,
                        "prefix_cache_hit_tokens": self.prefix_hits}
        self._last: list[dict[str, int]] = [dict.fromkeys(self._fields, 0)
                                            for _ in range(num_replicas)]
        for i in range(num_replicas):
            r = str(i)
            for metric in (self.in_flight, self.num_running, self.num_waiting, self.kv_usage,
                           self.prompt_tokens, self.generation_tokens, self.prefix_queries,
                           self.prefix_hits, self.hit_rate):
                metric.labels(model_name, r)
            self.up.labels(model_name, r).set(1)
            for reason in ("prefix", "load"):
                self.routed.labels(model_name, r, reason)

    def update(self, replica: int, stats: Any) -> None:
        """Gauges take the replica's current values; counters advance by the delta."""
        name, r = self.model_name, str(replica)
        self.num_running.labels(name, r).set(stats.num_running)
        self.num_waiting.labels(name, r).set(stats.num_waiting)
        self.kv_usage.labels(name, r).set(min(max(float(stats.kv_cache_usage), 0.0), 1.0))
        last = self._last[replica]
        for field, counter in self._fields.items():
            value = int(getattr(stats, field, 0) or 0)
            if value > last[field]:
                counter.labels(name, r).inc(value - last[field])
                if field == "prompt_tokens_total":  # every prompt token is looked up
                    self.prefix_queries.labels(name, r).inc(value - last[field])
            last[field] = value
        queries = last["prompt_tokens_total"]
        self.hit_rate.labels(name, r).set(last["prefix_cache_hit_tokens"] / queries if queries else 0.0)

    def set_in_flight(self, replica: int, in_flight: int) -> None:
        self.in_flight.labels(self.model_name, str(replica)).set(in_flight)

    def routed_to(self, replica: int, reason: str) -> None:
        self.routed.labels(self.model_name, str(replica), reason).inc()

    def set_up(self, replica: int, up: bool) -> None:
        self.up.labels(self.model_name, str(replica)).set(1 if up else 0)
