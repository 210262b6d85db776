"""Adaptive speculation length: follows acceptance and cost, turns off, probes again."""

from __future__ import annotations

from specserve import SamplingParams
from specserve.request import Request
from specserve.spec_decode.adaptive import AdaptiveLength, best_length


def test_best_length_follows_acceptance_and_cost():
    assert best_length(1.0, 5, 0.05) == 5
    assert best_length(0.3, 5, 0.02, overhead=0.7) == 0  # a costly verify needs acceptance
    assert best_length(0.8, 5, 0.02, overhead=0.7) == 5
    assert best_length(0.9, 5, 0.05) == 5
    assert 0 < best_length(0.5, 5, 0.05) < 5
    assert best_length(0.05, 5, 0.2) == 0
    assert best_length(0.99, 5, 1.2) == 0  # a draft as slow as the target never pays


def test_request_stops_then_probes():
    ctl = AdaptiveLength(5, probe_interval=4)
    req = Request("r", [1, 2, 3], SamplingParams(), set(), 0)
    assert ctl.num_drafts(req) > 0
    for _ in range(10):
        ctl.observe(req, ctl.num_drafts(req) or 1, 0)  # everything rejected
    ctl.observe_costs(1.0, 0.3)  # a slow-ish draft model
    ks = [ctl.num_drafts(req) for _ in range(8)]
    assert ks.count(0) == 6 and ks.count(1) == 2  # off, with a probe every 4 steps
    for _ in range(6):
        ctl.observe(req, 5, 5)  # the text became predictable
    assert ctl.num_drafts(req) >= 3


def test_verify_cost_is_learned():
    ctl = AdaptiveLength(5, verify_cost=0.1)
    for _ in range(30):
        ctl.observe_target_step(0.10, 1, 0, 1)  # plain decode step: 100 ms
        ctl.observe_target_step(0.18, 1, 5, 6)  # 5 drafts: +80 ms = 0.7 overhead + 5 * 0.02
    assert abs(ctl.verify_cost - 0.7) < 0.02
    ctl.observe_target_step(5.0, 1, 0, 500)  # a prefill: ignored
    ctl.observe_target_step(0.5, 4, 8, 12)  # another batch size: no plain time known yet
    assert abs(ctl.verify_cost - 0.7) < 0.02
    assert ctl.enabled and AdaptiveLength(5, enabled=False).num_drafts(None) == 5


def test_tree_gate_pauses_a_request_whose_trees_do_not_pay_and_probes_again():
    from specserve.spec_decode.adaptive import TreeGate

    gate = TreeGate(prior_cost=1.3, probe_interval=4)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=8), set(), 0)
    assert gate.active(req)  # optimistic start
    for _ in range(10):
        gate.observe(req, 1)  # every tree rejected: one token per (costlier) step
    assert [gate.active(req) for _ in range(4)] == [False, False, False, True]  # then a probe
    for _ in range(10):
        gate.observe(req, 4)
    assert gate.active(req)
    # the cost is learned from step times: trees twice as slow as plain steps
    gate.observe_step(0.02, 1, False)
    gate.observe_step(0.04, 1, True)
    assert gate.cost == 2.0
    assert TreeGate(enabled=False).active(req)
