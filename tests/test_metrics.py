"""Unit tests of specserve.metrics: exact exposed names, labels, deltas, the log line."""

from __future__ import annotations

import logging
import re

from specserve.engine import EngineStats as Stats  # the engine's own record, not a copy
from specserve.metrics import ServerMetrics, StatsLogger, format_spec_log
from specserve.request import CompletionOutput, RequestOutput

EXPECTED = {
    "specserve:num_requests_running": "gauge",
    "specserve:num_requests_waiting": "gauge",
    "specserve:kv_cache_usage_perc": "gauge",
    "specserve:prompt_tokens_total": "counter",
    "specserve:generation_tokens_total": "counter",
    "specserve:num_preemptions_total": "counter",
    "specserve:request_success_total": "counter",
    "specserve:time_to_first_token_seconds": "histogram",
    "specserve:inter_token_latency_seconds": "histogram",
    "specserve:e2e_request_latency_seconds": "histogram",
    "specserve:spec_decode_num_drafts_total": "counter",
    "specserve:spec_decode_num_draft_tokens_total": "counter",
    "specserve:spec_decode_num_accepted_tokens_total": "counter",
    "specserve:spec_decode_num_accepted_tokens_per_pos_total": "counter",
    "specserve:spec_decode_steps_total": "counter",
}


def test_every_field_the_metrics_read_is_the_engines():
    """The collectors read EngineStats by name: a renamed field must fail here, not zero a metric."""
    from dataclasses import fields

    from specserve.metrics import _COUNTER_FIELDS, _STEP_KINDS

    names = {f.name for f in fields(Stats)}
    assert set(_COUNTER_FIELDS) <= names and set(_STEP_KINDS.values()) <= names
    assert {"num_running", "num_waiting", "kv_cache_usage", "spec_accepted_per_pos"} <= names
    assert "num_preemptions" in _COUNTER_FIELDS


def samples(m: ServerMetrics) -> dict[str, float]:
    out = {}
    for line in m.render().decode().splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def output(rid: str, tokens: int, finished: bool = False, reason: str | None = None,
           arrival: float = 100.0, first: float | None = 100.5) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2], [CompletionOutput(0, "x" * tokens,
                                                             list(range(tokens)), reason)],
                         finished, arrival_time=arrival, first_token_time=first,
                         finished_time=103.0 if finished else None)


def test_exact_names_types_and_model_label():
    m = ServerMetrics("my-model")
    m.update_from_stats(Stats(spec_accepted_per_pos=[1]))
    m.observe_output(output("a", 1), now=100.5)
    m.observe_output(output("a", 2, True, "stop"), now=101.0)
    text = m.render().decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for name, kind in EXPECTED.items():
        base = name[:-len("_total")] if kind == "counter" else name
        assert kind in (types.get(name), types.get(base)), (name, types)
    for key in samples(m):
        assert 'model_name="my-model"' in key, key
        assert "_total_total" not in key
    for name in EXPECTED:
        assert re.search(rf"^{re.escape(name)}(_count|_bucket)?\{{", text, re.M), name


def test_counters_take_deltas_and_gauges_values():
    m = ServerMetrics("m")
    m.update_from_stats(Stats(num_running=3, num_waiting=2, kv_cache_usage=0.25,
                              prompt_tokens_total=10, generation_tokens_total=5,
                              spec_num_drafts=4, spec_num_draft_tokens=12,
                              spec_num_accepted_tokens=7, spec_accepted_per_pos=[4, 2, 1]))
    m.update_from_stats(Stats(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                              prompt_tokens_total=15, generation_tokens_total=9,
                              spec_num_drafts=6, spec_num_draft_tokens=18,
                              spec_num_accepted_tokens=9, spec_accepted_per_pos=[6, 2, 1]))
    s = samples(m)
    label = '{model_name="m"}'
    assert s["specserve:num_requests_running" + label] == 0
    assert s["specserve:kv_cache_usage_perc" + label] == 0.0
    assert s["specserve:prompt_tokens_total" + label] == 15
    assert s["specserve:generation_tokens_total" + label] == 9
    assert s["specserve:spec_decode_num_drafts_total" + label] == 6
    assert s["specserve:spec_decode_num_draft_tokens_total" + label] == 18
    assert s["specserve:spec_decode_num_accepted_tokens_total" + label] == 9
    per_pos = ('specserve:spec_decode_num_accepted_tokens_per_pos_total'
               '{model_name="m",position="%d"}')
    assert [s[per_pos % i] for i in range(3)] == [6, 2, 1]


def test_step_kinds_are_one_counter_by_kind():
    m = ServerMetrics("m")
    steps = 'specserve:spec_decode_steps_total{kind="%s",model_name="m"}'
    assert [samples(m)[steps % k] for k in ("drafting", "lookup_only", "plain")] == [0, 0, 0]
    m.update_from_stats(Stats(spec_steps_drafting=5, spec_steps_lookup_only=2, spec_steps_plain=1))
    m.update_from_stats(Stats(spec_steps_drafting=9, spec_steps_lookup_only=2, spec_steps_plain=4))
    assert [samples(m)[steps % k] for k in ("drafting", "lookup_only", "plain")] == [9, 2, 4]


def test_preemptions_counter_follows_the_engines_count():
    m = ServerMetrics("m")
    key = 'specserve:num_preemptions_total{model_name="m"}'
    assert samples(m)[key] == 0  # exported from the first scrape
    m.update_from_stats(Stats(num_preemptions=3))
    assert samples(m)[key] == 3
    m.update_from_stats(Stats(num_preemptions=3))  # no new preemption: no change
    assert samples(m)[key] == 3
    m.update_from_stats(Stats(num_preemptions=7))
    assert samples(m)[key] == 7
    assert "specserve:num_preemptions_total_total" not in m.render().decode()


def test_latency_histograms_and_success_counter():
    m = ServerMetrics("m")
    m.observe_output(output("r", 1), now=100.5)  # first token: TTFT 0.5
    m.observe_output(output("r", 4), now=101.1)  # 3 tokens in one step: 3 ITL samples of 0.2
    m.observe_output(output("r", 5, True, "length"), now=101.2)
    s = samples(m)
    label = '{model_name="m"}'
    assert s["specserve:time_to_first_token_seconds_count" + label] == 1
    assert abs(s["specserve:time_to_first_token_seconds_sum" + label] - 0.5) < 1e-9
    assert s["specserve:inter_token_latency_seconds_count" + label] == 4
    assert abs(s["specserve:inter_token_latency_seconds_sum" + label] - 0.7) < 1e-6
    assert s["specserve:e2e_request_latency_seconds_count" + label] == 1
    assert abs(s["specserve:e2e_request_latency_seconds_sum" + label] - 3.0) < 1e-9
    assert s['specserve:request_success_total{finished_reason="length",model_name="m"}'] == 1
    m.observe_output(output("q", 3, True, "abort"), now=102.0)  # aborted: counted, not timed
    s = samples(m)
    assert s['specserve:request_success_total{finished_reason="abort",model_name="m"}'] == 1
    assert s["specserve:time_to_first_token_seconds_count" + label] == 1
    assert s["specserve:e2e_request_latency_seconds_count" + label] == 1


def test_private_registries_do_not_collide():
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.update_from_stats(Stats(prompt_tokens_total=3))
    assert samples(a)['specserve:prompt_tokens_total{model_name="a"}'] == 3
    assert samples(b)['specserve:prompt_tokens_total{model_name="b"}'] == 0
    assert not any('model_name="a"' in key for key in samples(b))


def test_format_spec_log():
    assert format_spec_log(Stats()) == "spec decode: no drafts"
    prev = Stats(spec_num_drafts=10, spec_num_draft_tokens=30, spec_num_accepted_tokens=15,
                 spec_accepted_per_pos=[8, 5, 2])
    now = Stats(spec_num_drafts=20, spec_num_draft_tokens=60, spec_num_accepted_tokens=35,
                spec_accepted_per_pos=[17, 12, 6])
    line = format_spec_log(now)
    assert "mean acceptance length 2.75" in line
    assert "[0.850, 0.600, 0.300]" in line
    window = format_spec_log(now, prev)
    assert "mean acceptance length 3.00" in window
    assert "[0.900, 0.700, 0.400]" in window
    assert "accepted 20/30" in window


def test_stats_logger_logs_only_when_busy(caplog):
    logger = StatsLogger(interval=0.0, log=logging.getLogger("test.stats"))
    with caplog.at_level(logging.INFO, logger="test.stats"):
        assert logger.maybe_log(Stats()) is None  # idle from the start: nothing to say
        line = logger.maybe_log(Stats(num_running=2, generation_tokens_total=50,
                                      kv_cache_usage=0.5, spec_num_drafts=5,
                                      spec_num_draft_tokens=10, spec_num_accepted_tokens=5,
                                      spec_accepted_per_pos=[3, 2]))
    assert line is not None and "running 2" in line and "kv cache usage 50.0%" in line
    assert "mean acceptance length 2.00" in line
    assert line in caplog.text
