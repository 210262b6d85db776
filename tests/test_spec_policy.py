"""The cost model and the draft-budget policy, on synthetic cost curves: rows nearly free give
long drafts, rows costing linearly give none, a costly first row then cheap ones is handled,
requests compete for rows at high concurrency without slowing any one of them down, a head
that does not pay is gated off and probed, the measured model follows live steps, and
speculation measured slower end to end is switched off (then probed) per batch size."""

from __future__ import annotations

import copy

import math

import numpy as np
import pytest

from specserve.spec_decode.cost_model import (LOOKUP_ONLY, MIN_SAMPLES, PLAIN, PLAIN_CLIP, PLAIN_SAMPLE_EVERY,
                                              PLAIN_SAMPLES_FIRST, PLAIN_WEIGHT, PROBE_AFTER, PROBE_BUDGET,
                                              PROBE_RUN, QUICK_RATIO, QUICK_SAMPLES, SPEC, Curve, Realized,
                                              StepCostModel)
from specserve.spec_decode.draft_tree import DraftTree
from specserve.spec_decode.policy import AHEAD_MAX, FAIRNESS, PROBE_FIRST, ScoreCalibration, SpecPolicy


def model(f, per_request: float = 0.0, up_to: int = 512) -> StepCostModel:
    """A cost model whose one-request step over R rows takes f(R) seconds."""
    rows = sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256, up_to})
    return StepCostModel({r: f(r) for r in rows}, per_request)


def chain_tree(n: int, p: float) -> DraftTree:
    """A chain whose nodes are scored as if each were accepted with probability p."""
    return DraftTree.chain(list(range(10, 10 + n)), scores=[math.log(p ** (i + 1)) for i in range(n)])


def calibrated(policy: SpecPolicy) -> SpecPolicy:
    """Teach the policy that a node of draft probability q is accepted with probability q."""
    rng = np.random.default_rng(0)
    for _ in range(4000):
        q = rng.uniform(0.001, 1.0)
        policy.scores.observe(math.log(q), rng.uniform() < q)
    return policy


def select(policy, batch, trees):
    state = policy.new_state()
    values = [policy.values(state, t) for t in trees]
    return policy.select(batch, trees, values, [False] * len(trees), 4096)


def test_curve_interpolates_extrapolates_and_stays_monotone():
    c = Curve({1: 1.0, 4: 2.0, 8: 2.0})
    assert c(2) == pytest.approx(4 / 3) and c(8) == 2.0 and c(16) == 2.0  # flat last slope
    assert c(0.5) == pytest.approx(0.5)
    c.update(6, 5.0)  # a blended sample; the points after it are raised to stay monotone
    assert c(6) == pytest.approx(0.8 * 2.0 + 0.2 * 5.0) and c(8) >= c(6)
    c.update(6, 1000.0)  # a stall counts as at most three times the prediction
    assert c(6) == pytest.approx(0.8 * 2.6 + 0.2 * 3 * 2.6)
    assert np.allclose(c.many(np.array([1, 2, 6, 16])), [c(1), c(2), c(6), c(16)])


def test_rows_nearly_free_give_long_drafts():
    policy = calibrated(SpecPolicy(model(lambda r: 0.03 + 0.0001 * r), max_depth=16))
    keep = select(policy, 1, [chain_tree(8, 0.7)])
    assert keep == [list(range(8))]


def test_rows_costing_linearly_give_no_drafts():
    policy = calibrated(SpecPolicy(model(lambda r: 0.03 * r), max_depth=16))
    assert select(policy, 1, [chain_tree(8, 0.9)]) == [[]]
    assert select(policy, 16, [chain_tree(4, 0.9)] * 16) == [[]] * 16


def test_a_costly_first_row_then_cheap_ones():
    """CPU float32 on AVX2: 2..16 rows cost about 1.5x one row. One likely node does not pay
    for the jump; several do."""
    f = lambda r: 0.06 if r == 1 else 0.09 + 0.0005 * r  # noqa: E731
    policy = calibrated(SpecPolicy(model(f), max_depth=16))
    assert select(policy, 1, [chain_tree(1, 0.4)]) == [[]]
    assert select(policy, 1, [chain_tree(8, 0.8)]) == [list(range(8))]


def test_requests_compete_for_rows_at_high_concurrency():
    """Rows cost a third of a request's share each: the likeliest nodes of the batch get rows,
    and never so many that the worst-served request advances slower than in a plain step."""
    f = lambda r: 0.01 * r  # noqa: E731
    policy = calibrated(SpecPolicy(model(f, per_request=0.02), max_depth=16))
    trees = [chain_tree(4, 0.95)] * 8 + [chain_tree(4, 0.6)] * 8
    keep = select(policy, 16, trees)
    assert all(len(k) == 4 for k in keep[:8]) and all(0 < len(k) < 4 for k in keep[8:])
    slowdown = policy.cost.step_time(16, 16 + sum(map(len, keep))) / policy.cost.step_time(16, 16)
    worst = min(1 + policy.values(policy.new_state(), t)[k].sum() for t, k in zip(trees, keep))
    assert worst >= slowdown * (1 - FAIRNESS)


def test_no_request_is_slowed_down_for_the_others():
    """Two requests with excellent drafts would raise the batch's rate (16 + 2 x 3.7 tokens in
    1.13 plain steps), but the fourteen whose drafts are poor would advance 13% slower; one
    request without drafts caps the step near a plain one in the same way."""
    f = lambda r: 0.01 * r  # noqa: E731
    policy = calibrated(SpecPolicy(model(f, per_request=0.02), max_depth=16))
    assert select(policy, 16, [chain_tree(4, 0.95)] * 2 + [chain_tree(4, 0.3)] * 14) == [[]] * 16
    assert select(policy, 17, [chain_tree(4, 0.95)] * 16) == [[]] * 16
    assert select(policy, 16, [chain_tree(4, 0.95)] * 16) == [list(range(4))] * 16


def test_a_request_ahead_of_plain_decoding_may_give_some_of_its_lead_back():
    """The same batches as above, where the requests without good drafts are ahead of plain
    decoding (they accepted drafts before): the step may cost them part of that lead, never
    more than they have, and a lead is capped (AHEAD_MAX) and never negative."""
    f = lambda r: 0.01 * r  # noqa: E731
    policy = calibrated(SpecPolicy(model(f, per_request=0.02), max_depth=16))
    trees = [chain_tree(4, 0.95)] * 16
    values = [policy.values(policy.new_state(), t) for t in trees]
    keep = policy.select(17, trees, values, [False] * 16, 4096, [0.0] * 16, idle_ahead=3.0)
    assert keep == [list(range(4))] * 16  # the one without drafts is 3 tokens ahead
    assert policy.select(17, trees, values, [False] * 16, 4096, [0.0] * 16, idle_ahead=0.0) == [[]] * 16
    poor = [chain_tree(4, 0.95)] * 2 + [chain_tree(4, 0.3)] * 14
    values = [policy.values(policy.new_state(), t) for t in poor]
    ahead = [0.0] * 2 + [3.0] * 14
    keep = policy.select(16, poor, values, [False] * 16, 4096, ahead)
    assert keep[0] and keep[1]
    slowdown = policy.slowdown(16, 16 + sum(map(len, keep)))
    assert slowdown > 1 / (1 - FAIRNESS)  # past what a request without a lead may pay
    served = [1 + ahead[b] + values[b][nodes].sum() for b, nodes in enumerate(keep)]
    assert len(served) == 16 and min(served) >= slowdown * (1 - FAIRNESS)  # nobody falls behind plain
    state = policy.new_state()
    policy.advance(state, 5, 1.5)  # 5 tokens in 1.5 plain steps: 5 - 0.95 x 1.5 ahead
    assert state.ahead == pytest.approx(5 - (1 - FAIRNESS) * 1.5)
    for _ in range(10):
        policy.advance(state, 5, 1.0)
    assert state.ahead == AHEAD_MAX
    policy.advance(state, 1, AHEAD_MAX + 4)
    assert state.ahead == 0.0
    for _ in range(20):  # plain steps: the 5% budget builds up, a token in 20 steps
        policy.advance(state, 1, 1.0)
    assert state.ahead == pytest.approx(20 * FAIRNESS)


def test_a_larger_fairness_budget_lets_good_drafts_slow_the_others_that_much():
    """speculative_config "fairness": the batch the default refuses (two excellent drafts
    slowing fourteen poor ones) is verified in full with a budget of 20%, and with 8% only as
    far as slows the step by 1 / (1 - 0.08); a plain step adds the budget to a request's lead."""
    f = lambda r: 0.01 * r  # noqa: E731
    trees = [chain_tree(4, 0.95)] * 2 + [chain_tree(4, 0.3)] * 14
    kept = {}
    for fairness in (0.08, 0.2):
        policy = calibrated(SpecPolicy(model(f, per_request=0.02), max_depth=16, fairness=fairness))
        keep = select(policy, 16, trees)
        assert not any(keep[2:])
        kept[fairness] = len(keep[0]) + len(keep[1])
        assert policy.slowdown(16, 16 + kept[fairness]) <= 1 / (1 - fairness) + 1e-9
    assert 0 < kept[0.08] < kept[0.2] == 8  # the smaller budget binds; the default's verifies none
    state = policy.new_state()
    policy.advance(state, 1, 1.0)
    assert state.ahead == pytest.approx(0.2)


def test_probes_stay_within_the_others_slow_down_budget():
    """A request that has not verified for long gets its best node verified anyway, but at 16
    requests only as many such rows as slow the step by FAIRNESS; alone, it always probes."""
    f = lambda r: 0.01 * r  # noqa: E731
    policy = calibrated(SpecPolicy(model(f, per_request=0.02), max_depth=16))
    trees = [chain_tree(4, 0.3)] * 16
    values = [policy.values(policy.new_state(), t) for t in trees]
    keep = policy.select(16, trees, values, [True] * 16, 4096)
    rows = sum(map(len, keep))
    assert 0 < rows < 16 and all(k in ([], [0]) for k in keep)
    assert policy.cost.step_time(16, 16 + rows) <= policy.cost.step_time(16, 16) / (1 - FAIRNESS)
    assert policy.select(1, trees[:1], values[:1], [True], 4096) == [[0]]


def test_the_early_exit_changes_no_selection():
    """select's bound (_may_pay) only skips work: on random cost curves, trees, values, batch
    sizes and probes, it keeps exactly what the full computation keeps."""
    rng = np.random.default_rng(7)
    for trial in range(300):
        base, per_row, knee = rng.uniform(0.005, 0.05), rng.uniform(0, 0.01), rng.integers(1, 16)
        policy = calibrated(SpecPolicy(model(lambda r: base + per_row * max(0, r - knee) + 1e-4 * r,
                                             per_request=rng.uniform(0, 0.005)), max_depth=8))
        batch = int(rng.integers(1, 12))
        trees = [chain_tree(int(rng.integers(1, 9)), rng.uniform(0.05, 0.95))
                 for _ in range(int(rng.integers(1, batch + 1)))]
        state = policy.new_state()
        values = [policy.values(state, t) for t in trees]
        probes = [bool(rng.uniform() < 0.3) for _ in trees]
        fast = policy.select(batch, trees, values, probes, 4096)
        policy._may_pay = lambda *args: True
        assert policy.select(batch, trees, values, probes, 4096) == fast, trial


def test_score_calibration_learns_from_verified_nodes():
    """Likely nodes that keep being rejected lose their value (down to the next likelier bin's:
    a likelier node is never worth less); the unlikely bins keep theirs."""
    cal = ScoreCalibration()
    before, cut = cal.values(np.log([0.05, 0.9])), cal.min_score(0.8)
    for _ in range(200):
        cal.observe(math.log(0.9), False)
    after = cal.values(np.log([0.05, 0.9]))
    assert after[1] < before[1] - 0.15 and after[0] == before[0]
    assert cut == pytest.approx(math.log(0.8)) and cal.min_score(0.8) == 0.0  # no bin is worth 0.8 now


def test_a_new_request_starts_from_what_drafting_gave_the_others():
    """Under load a row costs much: a head that has accepted little for earlier requests, or
    whose trees selection refused, does not draft (nor run its first pass) for a new one until
    probed; with nothing known, it does."""
    policy = SpecPolicy(model(lambda r: 0.05 + 0.002 * r, per_request=0.004), max_depth=4)
    policy.draft_cost.update(64, 0.05)
    assert policy.draft_pays(policy.new_state(), 64, 64)  # nothing known yet: 1 token per step
    for _ in range(60):  # earlier requests: their drafts were accepted one time in five
        state = policy.new_state()
        state.drafted = True
        policy.observe(state, chain_tree(2, 0.5), [0] if _ % 5 == 0 else [], [])
    assert policy.gain < 0.4 and not policy.draft_pays(policy.new_state(), 64, 64)
    assert policy.draft_pays(policy.new_state(), 1, 1)  # alone, rows are cheap enough
    policy = SpecPolicy(model(lambda r: 0.05 + 0.002 * r, per_request=0.004), max_depth=4)
    policy.draft_cost.update(64, 0.05)
    for _ in range(30):  # alone, a refused tree costs only its drafting: no lesson for new requests
        policy.refused(policy.new_state(), 1)
    assert policy.gain == 1.0
    for _ in range(30):  # under load, earlier requests drafted but selection found nothing worth its rows
        policy.refused(policy.new_state(), 64)
    assert policy.gain < 0.4 and not policy.draft_pays(policy.new_state(), 64, 64)


def test_a_head_that_does_not_pay_is_gated_off_and_probed():
    policy = SpecPolicy(model(lambda r: 0.05 + 0.001 * r), max_depth=4)
    policy.draft_cost.update(1, 0.2)  # a head pass costs four target steps
    state = policy.new_state()
    runs = [policy.draft_pays(state, 1, 1) for _ in range(3 * PROBE_FIRST + 1)]
    assert runs[:PROBE_FIRST - 1] == [False] * (PROBE_FIRST - 1) and runs[PROBE_FIRST - 1]
    assert runs.count(True) == 2  # probes, the second after twice the wait
    policy.draft_cost = Curve({1: 0.001})  # a cheap head that accepts well
    state.gate.gain = 2.0
    assert policy.draft_pays(state, 1, 1) and state.gate.on


def test_a_head_does_not_draft_where_a_trusted_lookup_chain_leaves_it_too_little():
    """Beside a lookup chain the head is worth what it adds past the chain's accepted prefix
    (`beyond_lookup`): a request whose chains are accepted almost always skips the head's
    drafting (its gate untouched: no wait, no probe, counted), one whose chains fail drafts as
    without a chain, and a request without a chain as before; a gated-off head is still
    probed beside chains."""
    policy = SpecPolicy(model(lambda r: 0.05 + 0.001 * r), max_depth=8)
    policy.draft_cost.update(1, 0.02)  # drafting costs two fifths of a step
    trusted, failing = policy.new_state(), policy.new_state()
    chain = DraftTree.chain([1, 2, 3, 4, 5, 6])
    for _ in range(20):
        policy.observe(trusted, chain, [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5])
        policy.observe(failing, chain, [], [0, 1, 2, 3, 4, 5])
    for state in (trusted, failing):
        state.gate.gain = 2.0  # its head: two accepted tokens a drafting step
    assert policy.beyond_lookup(trusted, 6, 2.0) < 0.4 < 1.5 < policy.beyond_lookup(failing, 6, 2.0) <= 2.0
    assert policy.beyond_lookup(trusted, 0, 2.0) == 2.0  # no chain: all of it
    gate = copy.deepcopy(trusted.gate)
    assert not any(policy.draft_pays(trusted, 1, 1, 6) for _ in range(3 * PROBE_FIRST))
    assert trusted.gate == gate  # skipped, not gated off: nothing to wait out afterwards
    assert policy.draft_pays(trusted, 1, 1) and policy.draft_pays(failing, 1, 1, 6)
    trusted.gate.gain = 0.0  # a head gated off is still probed beside chains, after the usual waits
    runs = [policy.draft_pays(trusted, 1, 1, 6) for _ in range(PROBE_FIRST)]
    assert runs == [False] * (PROBE_FIRST - 1) + [True] and not trusted.gate.on


def test_no_adaptation_drafts_and_verifies_everything():
    policy = SpecPolicy(None, max_depth=4, adaptive=False)
    assert policy.draft_pays(policy.new_state(), 64, 64)
    assert policy.select(8, [chain_tree(3, 0.01)], [np.zeros(3)], [False], 4096) == [[0, 1, 2]]


def test_lookup_values_follow_the_requests_acceptance_by_depth():
    policy = SpecPolicy(model(lambda r: 0.05), max_depth=8)
    good, bad = policy.new_state(), policy.new_state()
    tree = DraftTree.chain([1, 2, 3, 4])
    for _ in range(20):
        policy.observe(good, tree, [0, 1, 2, 3], [0, 1, 2, 3])
        policy.observe(bad, tree, [], [0, 1, 2, 3])
    good.chain_nodes = bad.chain_nodes = [0, 1, 2, 3]
    v_good, v_bad = policy.values(good, tree), policy.values(bad, tree)
    assert v_good[0] > 0.8 and v_bad[0] < 0.2
    assert all(np.diff(v_good) <= 0)  # a child is never worth more than its parent


def test_worst_served_is_the_least_served_request_after_each_node():
    """The fairness check's running least (1 + lead + expected accepted tokens over the
    requests with drafts), against its definition: every request's sum after each prefix of
    the nodes, ties and leads included."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        requests = rng.randint(1, 12)
        ahead = np.array([rng.choice([0.0, 0.0, 0.5, rng.uniform(0, 8)]) for _ in range(requests)])
        nodes = sorted((-rng.choice([0.0, 0.25, rng.random()]), 0, rng.randrange(requests), i)
                       for i in range(rng.randint(1, 40)))
        sums = 1.0 + ahead
        want = []
        for neg, _, r, _ in nodes:
            sums = sums.copy()
            sums[r] += -neg
            want.append(sums.min())
        got = SpecPolicy._worst_served([-n[0] for n in nodes], [n[2] for n in nodes], ahead)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_a_verified_lookup_chain_teaches_each_depth_up_to_its_first_rejected_node():
    policy = SpecPolicy(model(lambda r: 0.05), max_depth=8)
    for accepted in range(0, 7):
        state = policy.new_state()
        tree = DraftTree.chain([1, 2, 3, 4, 5, 6], scores=[None] * 6)
        policy.observe(state, tree, list(range(accepted)), list(range(6)))
        seen = min(6, accepted + 1)  # depths tried: every accepted one and the first rejected one
        assert state.lookup.tried == [1.0] * seen + [0.0] * (8 - seen)
        assert state.lookup.accepted == [1.0] * accepted + [0.0] * (8 - accepted)


def test_measured_model_follows_live_steps():
    cost = StepCostModel({1: 0.05, 2: 0.05, 8: 0.05}, per_request=0.0, plain={4: 0.06})
    for _ in range(40):
        cost.observe(1, 8, 0.10)  # verify steps of 8 rows turn out twice as slow
        cost.observe(4, 4, 0.09)  # plain steps of 4 requests: slower than measured at start
    assert cost.step_time(1, 8) == pytest.approx(0.10, rel=0.05)
    assert cost.step_time(4, 4) == pytest.approx(0.09, rel=0.05)
    assert cost.row_price(1, 7) == pytest.approx((0.10 - 0.05) / 7, rel=0.1)
    assert cost.step_time(2, 2) == pytest.approx(0.05 + 0.04 / 3, rel=0.05)  # between 1 and 4
    for _ in range(40):  # each draft row at B = 4 costs 0.004 s more than the rows curve says
        cost.observe(4, 12, cost.plain_time(4) + cost.rows(12) - cost.rows(4) + 8 * 0.004)
    assert cost.extra(4) == pytest.approx(0.004, rel=0.05)
    assert cost.step_time(4, 8) - cost.step_time(4, 4) == pytest.approx(cost.rows(8) - cost.rows(4) + 0.016, rel=0.05)
    assert cost.step_time(4, 4) == pytest.approx(0.09, rel=0.05)  # plain steps are not charged
    assert cost.step_time(1, 8) == pytest.approx(0.10, rel=0.05)  # nor one request
    assert cost.extra(6) == cost.extra(4)  # a batch size without steps with drafts reads the nearest
    for _ in range(40):  # the rows curve moves (live steps of one request): a step with drafts
        cost.observe(1, 12, 0.20)  # moves by its rows' share, its plain reference not at all
    assert cost.step_time(4, 4) == pytest.approx(0.09, rel=0.05)


def test_a_drift_of_the_whole_step_is_not_charged_to_draft_rows():
    """Steps grow slower as contexts grow, plain steps and steps with one or two draft rows
    alike (a row costs what the rows curve says, nothing more): extra(B) stays near zero,
    where an average of (seconds - plain) per draft row would read the drift between plain
    samples as a cost of rows (~1 ms a row here, a quarter of the rows curve's price)."""
    cost = StepCostModel({1: 0.02, 4: 0.024, 16: 0.04}, per_request=0.0, plain={4: 0.05})
    for i in range(400):
        t = 0.05 + 0.0002 * i  # the whole step drifts by 3.4 ms between plain samples
        drafts = 0 if i % 17 == 0 else 1 + i % 2
        cost.observe(4, 4 + drafts, t + cost.rows(4 + drafts) - cost.rows(4))
    assert cost.extra(4) < 0.0003
    for i in range(60):  # rows that do cost 2 ms more each: learnt, whatever the drift
        drafts = 0 if i % 17 == 0 else 1 + i % 8
        cost.observe(4, 4 + drafts, 0.13 + 0.0002 * i + cost.rows(4 + drafts) - cost.rows(4) + 0.002 * drafts)
    assert cost.extra(4) == pytest.approx(0.002, rel=0.15)


def test_a_batch_size_met_for_a_few_steps_is_judged_by_them():
    cost = StepCostModel({1: 0.05, 64: 0.05}, per_request=0.01, plain={16: 0.20})
    assert cost.step_time(8, 8) == pytest.approx(0.05 + 0.15 * 7 / 15)  # interpolated
    for _ in range(3):  # a load's tail: three plain steps at 8 requests, far cheaper
        cost.observe(8, 8, 0.08)
    assert cost.step_time(8, 8) == pytest.approx((0.12 + 3 * 0.08) / 4)  # the prior counts as one step
    cost.observe(16, 17, 0.18)  # one draft row, a step 20 ms faster than plain (noise):
    assert cost.extra(16) == 0.0  # 72 draft rows do not become free
    assert cost.step_time(16, 88) - cost.step_time(16, 16) == pytest.approx(cost.rows(88) - cost.rows(16))


def run_realized(gate: Realized, batch: int, steps: int, spec_cost: float, plain_cost: float = 1.0,
                 spec_tokens: float = 1.0, spread: float = 0.0) -> list[bool]:
    """Drive the gate with steps whose seconds per token are spec_cost (speculating) or
    plain_cost (plain), each relative to the model's plain step time of 1 s; with `spread`,
    every other step takes that share more or less (a machine's noise)."""
    modes = []
    for i in range(steps):
        spec = gate.speculate(batch)
        modes.append(spec)
        tokens = round(batch * spec_tokens) if spec else batch
        seconds = (spec_cost if spec else plain_cost) * tokens / batch * (1 + spread * (-1) ** i)
        gate.observe(batch, spec, seconds, tokens, 1.0)
    return modes


def test_speculation_measured_slower_is_switched_off_and_probed():
    gate = Realized()
    modes = run_realized(gate, 16, 400, spec_cost=1.1, spread=0.1)  # 10% slower per token than plain
    assert not modes[0]  # the first step at a batch size measures plain
    off = modes.index(False, 1)  # speculation goes off once judged on enough samples ...
    assert off == 1 + MIN_SAMPLES and sum(modes[off:]) <= PROBE_RUN * 4  # ... and only probe runs follow
    assert modes[off:off + PROBE_AFTER - 1] == [False] * (PROBE_AFTER - 1)
    assert run_realized(Realized(), 1, 200, spec_cost=1.1, spread=0.1).count(True) <= MIN_SAMPLES + 3 * PROBE_RUN


def test_free_drafts_are_not_judged_at_batch_1(make_llm, tiny_model_dir):
    """Steps whose drafts cost no model time (prompt lookup, suffix decoding: Realized.free)
    stay on at batch 1 however they measure, with no plain samples (nothing to judge them
    by); above it, and for a kind that is not free (EAGLE's lookup chains alone, say), the
    verdict stands. Lookup and suffix decoders mark their steps free."""
    gate = Realized()
    gate.free = frozenset([SPEC])
    assert run_realized(gate, 1, 200, spec_cost=1.5, spread=0.1) == [True] * 200 and not gate.off
    assert run_realized(gate, 16, 200, spec_cost=1.5, spread=0.1).count(True) <= MIN_SAMPLES + 3 * PROBE_RUN
    gate = Realized()
    gate.free = frozenset([LOOKUP_ONLY])
    assert run_realized(gate, 1, 200, spec_cost=1.5, spread=0.1).count(True) <= MIN_SAMPLES + 3 * PROBE_RUN
    for config, free in (({"method": "ngram"}, {SPEC}), ({"method": "suffix"}, {SPEC})):
        llm = make_llm(str(tiny_model_dir), max_model_len=256, speculative_config=config)
        assert llm.engine.spec.policy.realized.free == free


def test_one_outlying_plain_sample_does_not_stand_for_plain():
    """A bucket's first plain sample 30% slow (a stalled step): speculation 10% slower than
    plain goes off within PLAIN_SAMPLE_EVERY steps, not after it (plain's rate is the mean of
    its first samples, which come four times as often); with one plain sample standing for
    the rate it would stay on. Once the rate is settled, a stalled step moves it by at most
    PLAIN_CLIP of the EMA's weight."""
    gate = Realized()
    assert gate.speculate(16) == PLAIN
    gate.observe(16, PLAIN, 1.3, 16, 1.0)
    modes = "".join("S" if m else "." for m in run_realized(gate, 16, 200, spec_cost=1.1, spread=0.1))
    assert 0 <= modes.find("." * (PROBE_AFTER - 1)) < PLAIN_SAMPLE_EVERY
    settled = gate.plain[gate.bucket(16)]
    gate.observe(16, PLAIN, 1.3 * settled, 16, 1.0)
    assert gate.plain[gate.bucket(16)] == pytest.approx(settled * (1 + PLAIN_WEIGHT * PLAIN_CLIP))


def test_a_kind_conclusively_slower_on_its_first_samples_is_judged_on_them():
    """Steps of 16 requests with drafts 10% slower per token, all alike or spreading by 3%, are
    judged before MIN_SAMPLES (on QUICK_SAMPLES when alike); spreading by 10% (or 3% slower, spreading by
    4%), their first samples say too little, and MIN_SAMPLES judge them. Faster steps, however
    few or alike, are never judged slower."""
    assert run_realized(Realized(), 16, 40, spec_cost=1.1).index(False, 1) == 1 + QUICK_SAMPLES
    early = run_realized(Realized(), 16, 40, spec_cost=1.1, spread=0.03).index(False, 1)
    assert 1 + QUICK_SAMPLES < early < 1 + MIN_SAMPLES
    for cost, spread in ((1.1, 0.1), (1.03, 0.04)):
        assert run_realized(Realized(), 16, 40, spec_cost=cost, spread=spread).index(False, 1) == 1 + MIN_SAMPLES
    for batch in (1, 16):
        gate = Realized()
        assert run_realized(gate, batch, 40, spec_cost=0.9).count(False) <= PLAIN_SAMPLES_FIRST and not gate.off
    for batch in (1, 4):  # at 1-4 requests a request's first steps are not its later ones: MIN_SAMPLES
        assert run_realized(Realized(), batch, 40, spec_cost=1.1).index(False, 1) == 1 + MIN_SAMPLES


def test_probes_of_a_far_slower_speculation_cost_about_their_budget(monkeypatch):
    """Where speculation measured 2.7x plain's seconds per token (drafting dearer than a
    forward, as a GPU's graph-replayed step against the head's passes), its probe runs come
    rarely enough to cost about PROBE_BUDGET of the time after the first verdict, not a run
    of PROBE_RUN steps every PROBE_MAX; near plain (1.1x) the doubling schedule is unchanged."""
    steps = 4000
    modes = run_realized(Realized(), 16, steps, spec_cost=2.7)
    off = modes.index(False, 1)
    assert sum(modes[off:]) * 1.7 / steps <= 2 * PROBE_BUDGET  # plain steps lost to probes
    near = run_realized(Realized(), 16, 1000, spec_cost=1.1)
    monkeypatch.setattr(Realized, "_affordable", staticmethod(lambda ratio: 0))  # the doubling alone
    assert near == run_realized(Realized(), 16, 1000, spec_cost=1.1)
    assert sum(run_realized(Realized(), 16, steps, spec_cost=2.7)[off:]) > 3 * sum(modes[off:])


def test_a_far_slower_kind_is_judged_on_a_few_steps_and_probed_briefly():
    """Steps with drafts at 2.2x plain's seconds per token (a GPU's graph-replayed plain step
    against a step's host work and draft passes) are judged after QUICK_SAMPLES of them, wait
    what their probes can afford before the first probe (not PROBE_AFTER) and probe in runs
    of QUICK_SAMPLES + 1; a kind under QUICK_RATIO keeps the schedule of MIN_SAMPLES."""
    modes = run_realized(Realized(), 64, 3000, spec_cost=2.2)
    off = modes.index(False, 1)
    assert off == 1 + QUICK_SAMPLES
    runs, start = [], None
    for i, on in enumerate(modes[off:] + [False], off):
        if on and start is None:
            start = i
        elif not on and start is not None:
            runs.append((start, i - start))
            start = None
    assert runs and {n for _, n in runs} == {QUICK_SAMPLES + 1}
    assert runs[0][0] - off >= 0.95 * Realized._affordable(2.2) > 10 * PROBE_AFTER
    near = run_realized(Realized(), 64, 100, spec_cost=0.95 * QUICK_RATIO, spread=0.3)
    assert near.index(False, 1) == 1 + MIN_SAMPLES and near[1 + MIN_SAMPLES + PROBE_AFTER - 1]


def test_quiet_while_the_next_probe_is_further_off_than_the_features_needed():
    """Realized.quiet(batch, n): SPEC measured slower at that batch size, no probe run under
    way and the next one more than n steps off; never for another batch size, nor once a new
    batch is to be probed at once."""
    gate = Realized()
    run_realized(gate, 64, 1 + MIN_SAMPLES + 1, spec_cost=1.1, spread=0.1)  # off: the first probe after PROBE_AFTER
    assert not gate.quiet(64, PROBE_AFTER) and not gate.quiet(1, 8) and not Realized().quiet(64, 8)
    quiet, modes = [], []
    for _ in range(PROBE_AFTER + 4):
        quiet.append(gate.quiet(64, 8))
        modes += run_realized(gate, 64, 1, spec_cost=1.1)
    probe = modes.index(True)
    # features shown in the 8 steps up to the probe's (a step shows its features, then drafts)
    assert quiet[:probe - 7] == [True] * (probe - 7) and not any(quiet[probe - 7:])
    far = Realized()
    run_realized(far, 64, 1 + QUICK_SAMPLES + 1, spec_cost=3.0)
    assert far.quiet(64, 32) and not far.quiet(64, 2000)  # its first probe ~1000 steps off
    far.new_requests(64, 64)
    assert not far.quiet(64, 32)


def test_a_larger_batch_starts_from_a_smaller_ones_far_verdict():
    """A batch size above 4 with no samples of a kind takes the nearest smaller one's verdict
    where that was far slower (a GPU: 3x at 16 in flight): it starts off, quiet, and probes
    after what its probes can afford; never from a near verdict, a larger batch size's, or
    batches of 4 and fewer."""
    gate = Realized()
    run_realized(gate, 16, 1 + QUICK_SAMPLES + 1, spec_cost=3.0)
    modes = run_realized(gate, 64, 1100, spec_cost=3.0)
    assert not any(modes[:1000])
    # one probe, until its own QUICK_SAMPLES judge it
    assert 0 < modes.count(True) <= QUICK_SAMPLES + 1 and modes.index(True) >= Realized._affordable(3.0)
    fresh = Realized()
    run_realized(fresh, 16, 1 + QUICK_SAMPLES + 1, spec_cost=3.0)
    run_realized(fresh, 64, 2, spec_cost=3.0)
    assert fresh.quiet(64, 32)
    for batch, cost, other in ((16, 1.3, 64), (64, 3.0, 16), (4, 3.0, 64)):
        gate = Realized()
        run_realized(gate, batch, 1 + MIN_SAMPLES + 1, spec_cost=cost)
        assert run_realized(gate, other, 2, spec_cost=cost)[1]  # speculates: samples of its own


def run_kinds(gate: Realized, steps: int, cost: dict[int, float], fallback: bool = True) -> list[int]:
    """Drive the gate at batch 1 with steps of each kind at cost[kind] seconds per token
    (relative to plain's 1 s), no kind re-warming anything."""
    kinds = []
    for _ in range(steps):
        kind = gate.speculate(1, fallback)
        kinds.append(kind)
        gate.observe(1, kind, cost[kind] if kind else 1.0, 1, 1.0)
    return kinds


def test_a_losing_proposer_falls_back_to_lookup_chains_judged_apart():
    """Steps with the per-request proposer 20% slower than plain, with lookup chains alone 20%
    faster: after SPEC's verdict the gate runs LOOKUP_ONLY steps (SPEC probed at its doubling
    schedule), never plain but its samples; with no fallback (ngram, suffix) it runs plain
    steps. Lookup chains slower too: plain but for both kinds' probes."""
    kinds = run_kinds(Realized(), 600, {SPEC: 1.2, LOOKUP_ONLY: 0.8})
    off = kinds.index(LOOKUP_ONLY)
    assert kinds[:off] == [PLAIN] + [SPEC] * MIN_SAMPLES
    assert kinds[off:].count(SPEC) <= 5 * PROBE_RUN
    assert kinds[off:].count(PLAIN) <= PLAIN_SAMPLES_FIRST + 600 // PLAIN_SAMPLE_EVERY
    assert LOOKUP_ONLY not in run_kinds(Realized(), 600, {SPEC: 1.2, LOOKUP_ONLY: 0.8}, fallback=False)
    both = run_kinds(Realized(), 600, {SPEC: 1.2, LOOKUP_ONLY: 1.2})
    assert both[off:].count(PLAIN) >= 600 - off - MIN_SAMPLES - 2 * 5 * PROBE_RUN  # probes of each kind
    assert both[off:off + MIN_SAMPLES] == [LOOKUP_ONLY] * MIN_SAMPLES  # judged on its own samples


def test_speculation_judged_on_tokens_over_time_not_on_per_step_ratios():
    """Steps with drafts that alternate one and four tokens at 1.6 plain steps each give 0.64
    s per token: a win, although the mean of the steps' own seconds per token (1.6 and 0.4)
    is a plain step's."""
    gate, modes = Realized(), []
    for i in range(300):
        spec = gate.speculate(1)
        modes.append(spec)
        tokens = (1, 4)[i % 2] if spec else 1
        gate.observe(1, spec, 1.6 if spec else 1.0, tokens, 1.0)
    assert gate.rate(1) == pytest.approx(1.6 / 2.5, rel=0.05)
    assert modes[-100:].count(False) <= 2


def test_speculation_measured_faster_stays_on_with_rare_plain_samples():
    gate = Realized()
    modes = run_realized(gate, 1, 300, spec_cost=0.6, spec_tokens=2.0)
    assert modes.count(False) <= PLAIN_SAMPLES_FIRST + 300 // PLAIN_SAMPLE_EVERY
    # a probe that finds speculation winning again turns it back on
    gate = Realized()
    run_realized(gate, 16, 100, spec_cost=1.2)
    modes = run_realized(gate, 16, 400, spec_cost=0.7)
    assert modes[-100:].count(False) <= 2
    assert gate.bucket(15) == gate.bucket(16) != gate.bucket(64) and gate.bucket(3) == 3


def test_a_new_request_is_judged_on_its_own_steps():
    """At batch 1 the gate's verdict was measured on the request before: a new one probes at
    once and is judged on MIN_SAMPLES of its own steps, whose first (the proposer re-warming)
    costs more. One arrival among 16 changes nothing."""
    gate = Realized()
    run_realized(gate, 1, 100, spec_cost=1.3)  # a request speculation does not suit: gated off
    assert not gate.speculate(1)
    gate.new_requests(1, 1)
    modes = [gate.speculate(1)]
    gate.observe(1, True, 3.0, 1, 1.0)  # its first speculative step: three plain steps' time
    modes += run_realized(gate, 1, 60, spec_cost=0.5, spec_tokens=2.0)  # then a good one
    assert all(modes[:MIN_SAMPLES + 1]) and modes[-20:].count(False) <= 1
    busy = Realized()
    run_realized(busy, 16, 100, spec_cost=1.3)
    twin = copy.deepcopy(busy)
    busy.new_requests(1, 16)
    assert run_realized(busy, 16, 200, spec_cost=1.3) == run_realized(twin, 16, 200, spec_cost=1.3)


def test_calibration_stays_inside_a_short_context(make_llm, tiny_model_dir):
    """`--max-model-len 64` once crashed the server at start: the cost model timed 64 rows
    after 128 tokens of context, past the model's positions."""
    from specserve.spec_decode.cost_model import _time_step

    engine = make_llm(str(tiny_model_dir), max_model_len=48, speculative_config=None).engine
    assert _time_step(engine.runner, engine.kv, 1, 64) is None  # does not fit: not timed
    assert _time_step(engine.runner, engine.kv, 1, 16) > 0
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_a_step_that_admits_a_request_verifies_drafts(make_llm, tiny_model_dir):
    """Three requests in flight, the next sent when one finishes: every step after a finish
    holds the successor's prefill beside the others' decodes, and its kind was chosen at one
    request fewer, a batch size whose plain step (asked for by the cost model, then by
    Realized) is never measured, since a step with a prefill chunk measures nothing. Each ask
    is taken once: later such steps verify drafts (all of them were plain steps while the
    measurement was asked for again at every one); greedy output is plain decoding's."""
    from specserve import SamplingParams

    prompts = [[5, 9, 17, 33] * 3 + [5, 9], [7, 8, 7, 8, 7, 8, 7], [11, 12, 13, 11, 12, 13, 11]] * 4
    lengths = [30, 9, 17, 23] * 3  # finishes spread out, so that the others are mid-decode
    kw = {"max_num_seqs": 3, "max_model_len": 128, "num_blocks": 64}

    def run(llm):
        engine, outputs, mixed, sent = llm.engine, {}, [], 0
        execute = engine.runner.execute

        def send():
            nonlocal sent
            engine.add_request(str(sent), prompts[sent], SamplingParams(temperature=0, max_tokens=lengths[sent]))
            sent += 1

        def logged(sched, *a):  # a step with a prefill chunk beside requests that decode
            if not sched.decode_only and any(r.num_output_tokens for r in sched.requests):
                mixed.append((engine.spec._interval[2] if engine.spec._interval else PLAIN, sum(sched.num_drafts)))
            return execute(sched, *a)

        engine.runner.execute = logged
        while sent < 3:
            send()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
                    if sent < len(prompts):
                        send()
        return outputs, mixed

    ref, _ = run(make_llm(str(tiny_model_dir), speculative_config=None, **kw))
    # suffix decoding: a prompt's second and third requests draft from the first one's output
    llm = make_llm(str(tiny_model_dir), speculative_config={"method": "suffix", "num_speculative_tokens": 4}, **kw)
    spec = llm.engine.spec
    spec.policy.realized._on = lambda b, kind, plain: True  # never judged slower (tiny model timings)
    spec.policy.select = lambda batch, trees, *a, **k: [list(range(len(t))) for t in trees]  # verify all
    outputs, mixed = run(llm)
    assert outputs == ref
    kinds = [kind for kind, _ in mixed]
    assert len(mixed) >= 6 and kinds.count(PLAIN) <= 4  # a plain step asked once per batch size and bucket
    assert sum(1 for _, drafts in mixed if drafts) >= 3
