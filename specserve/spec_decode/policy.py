"""How much to draft and verify, from measured costs and measured acceptance: the one
draft-budget policy of every method (the reasoning and its measurements: docs/speculation.md,
"The cost model and the policy").

A plain step of B requests emits B tokens in t(B, B) seconds (StepCostModel); verifying n draft
nodes emits B + (their expected accepted count) in t(B, B + n). Invariants:
  * v(node) = P(the node ends on the accepted path), from `ScoreCalibration` for scored nodes
    and from `Rates` by depth for lookup nodes; a child is never worth more than its parent, so
    the most valuable nodes always form trees;
  * `select` verifies the count of best nodes that maximises the step's rate, none unless that
    beats plain by `MARGIN`, and no request advances slower than in a plain step (`FAIRNESS`,
    the config's "fairness") beyond the lead over plain decoding it gained before
    (`RequestState.ahead`, `AHEAD_MAX`);
  * `draft_pays`: a proposer with a cost per request drafts for it only while its expected
    accepted tokens pay for its share of drafting and its rows, else after doubling waits;
  * `min_score`: nodes that cannot pay the cheapest row are neither expanded nor returned.
With "adaptive": false the proposer drafts its maximum and all of it is verified.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from specserve.spec_decode.cost_model import Curve, Realized, StepCostModel
from specserve.spec_decode.draft_tree import DraftTree

MARGIN = 0.10  # speculate only when the predicted step rate beats plain by this much (the
# prediction errs by about this much under load: contexts drift, acceptance is an estimate)
FAIRNESS = 0.05  # how much slower than in a plain step a request may advance in a step with drafts
# (the default of speculative_config "fairness": a budget over each request's life, see advance)
AHEAD_MAX = 8.0  # tokens of its lead over plain decoding a request may give back to others' drafts
PROBE_FIRST, PROBE_MAX = 8, 128  # steps between probes of a gated-off request (doubling)
SCORE_BINS = np.array([0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0001])
_EDGES = SCORE_BINS.tolist()  # for bisect, per verified node


def _lookup_only(tree: DraftTree, chain_nodes: list[int]) -> bool:
    """Whether the tree is a lookup chain alone: a chain, every node of it from lookup, none scored."""
    n = len(tree)
    return chain_nodes == list(range(n)) and tree.is_chain and (tree.scores is None or tree.scores.count(None) == n)


class Rates:
    """accepted / tried per index (a depth, a score bin), both decayed at each observation.
    Python lists: read and written a few entries at a time for every request every step,
    where a numpy scalar costs several times a float."""

    def __init__(self, accepted, tried, decay: float) -> None:
        self.accepted, self.tried, self.decay = [float(a) for a in accepted], [float(t) for t in tried], decay

    def rates(self) -> np.ndarray:
        return np.array(self.accepted) / np.array(self.tried)

    def observe(self, i: int, accepted: bool) -> None:
        if 0 <= i < len(self.tried):
            self.accepted[i] = self.accepted[i] * self.decay + accepted
            self.tried[i] = self.tried[i] * self.decay + 1


class ScoreCalibration:
    """P(scored node on the accepted path) by its draft path probability, in bins."""

    def __init__(self, decay: float = 0.998) -> None:
        centers = (SCORE_BINS[:-1] + SCORE_BINS[1:]) / 2
        self.by_bin = Rates(centers * 2, np.full(len(centers), 2.0), decay)
        self._curve: np.ndarray | None = None  # value by bin, as last computed (read per request per step)

    def curve(self) -> np.ndarray:
        """The value of a node by its bin: never less for a likelier node."""
        if self._curve is None:
            self._curve = np.maximum.accumulate(self.by_bin.rates())
        return self._curve

    def values(self, scores: np.ndarray) -> np.ndarray:
        bins = np.clip(np.searchsorted(SCORE_BINS, np.exp(scores), "right") - 1, 0, len(SCORE_BINS) - 2)
        return self.curve()[bins]

    def observe(self, score: float, accepted: bool) -> None:
        """The bin as in `values`, by bisect: one call per verified node, no numpy scalars."""
        self.by_bin.observe(min(max(bisect.bisect_right(_EDGES, math.exp(score)) - 1, 0), len(SCORE_BINS) - 2),
                            accepted)
        self._curve = None

    def min_score(self, value: float) -> float:
        """The log draft probability from which nodes are worth `value`."""
        ok = np.flatnonzero(self.curve() >= value)
        return math.log(max(SCORE_BINS[ok[0]], 1e-9)) if len(ok) else 0.0


@dataclass
class Gate:
    """One request's drafting switch for a proposer that costs time per request."""

    gain: float = 1.0  # EMA: accepted drafted tokens per drafting step (starts at SpecPolicy.gain)
    rows: float = 2.0  # EMA: verified drafted rows per drafting step
    on: bool = True
    idle: int = 0
    interval: int = PROBE_FIRST


@dataclass
class RequestState:
    """Everything the decoder keeps for one request between steps."""

    lookup: Rates  # P(lookup node at depth d + 1 accepted | its parent accepted)
    gate: Gate = field(default_factory=Gate)
    tree: DraftTree | None = None  # the drafts put on the request for its next step
    chain_nodes: list[int] = field(default_factory=list)  # nodes of `tree` that came from lookup
    drafted: bool = False  # the per-request proposer ran for it this step
    counts: object | None = None  # sampling.TokenCounts, for requests with penalties
    unverified: int = 0  # steps its drafts were not verified since they last were
    probe_every: int = PROBE_FIRST  # verify its best node anyway after this many such steps
    grammar: object | None = None  # structured.Matcher, for requests with structured output
    masks: object | None = None  # its bit masks of the root and of `tree`'s nodes (int32 [1 + n, words])
    ahead: float = 0.0  # expected tokens it is ahead of plain decoding (<= AHEAD_MAX), see select


class SpecPolicy:
    def __init__(self, cost: StepCostModel | None, max_depth: int, adaptive: bool = True,
                 min_draft_prob: float | None = None, fairness: float = FAIRNESS) -> None:
        self.cost = cost
        self.fairness = fairness
        self.adaptive = adaptive and cost is not None
        self.min_draft_prob = min_draft_prob  # the user's fixed cut instead of the cost model's
        self.max_depth = max_depth
        self.lookup = Rates(np.ones(max_depth), np.full(max_depth, 2.0), 0.98)  # decoder-wide, by depth
        self.scores = ScoreCalibration()
        self.draft_cost = Curve()  # seconds of a proposer call by requests drafted for
        self.gain = 1.0  # EMA over every request: accepted drafted tokens per drafting step (see refused)
        self.realized = Realized()  # whole steps, speculating vs plain, by batch size

    def new_state(self) -> RequestState:
        return RequestState(Rates(np.zeros(self.max_depth), np.zeros(self.max_depth), 0.8), Gate(self.gain))

    # -- prices ----------------------------------------------------------------------------------
    def plain_rate(self, batch: int) -> float:
        return batch / self.cost.step_time(batch, batch)

    def min_score(self, batch: int) -> float:
        """Nodes below this score cannot pay the cheapest row at this batch size."""
        if self.min_draft_prob is not None:
            return math.log(self.min_draft_prob) if self.min_draft_prob > 0 else -math.inf
        if not self.adaptive:
            return -math.inf
        price = min(self.cost.row_price(batch, n) for n in (1, 2, 4, 8, 16, 32))
        return self.scores.min_score(self.plain_rate(batch) * price)

    def draft_pays(self, state: RequestState, batch: int, num_drafting: int, chain: int = 0) -> bool:
        """Whether the per-request proposer should draft for this request this step, beside a
        lookup chain of `chain` tokens: the request's gate (on while its gain pays for its share
        of drafting and its rows, else probed after doubling waits), and with the gate on, not
        while what it is expected to add past the chain (`beyond_lookup`) pays for less (the
        gate stays on: the next step without such a chain drafts)."""
        g = state.gate
        if not self.adaptive:
            return True
        share = self.draft_cost(max(1, num_drafting)) / max(1, num_drafting)
        rows = max(1.0, g.rows)
        price = self.cost.row_price(batch, max(1, round(rows * batch)))
        need = self.plain_rate(batch) * (share + rows * price) * (1 + MARGIN)
        g.on = g.gain >= need
        if g.on:
            g.idle, g.interval = 0, PROBE_FIRST
            return not chain or self.beyond_lookup(state, chain, g.gain) >= need
        g.idle += 1
        if g.idle >= g.interval:  # probe: its result decides what comes next
            g.idle, g.interval = 0, min(PROBE_MAX, 2 * g.interval)
            return True
        return False

    def beyond_lookup(self, state: RequestState, chain: int, gain: float) -> float:
        """The tokens a proposer that gains `gain` a step is expected to add past the request's
        lookup chain of `chain` tokens: where the chain's accepted prefix stops at j tokens (by
        the request's lookup acceptance by depth), max(0, gain - j), weighted by its likelihood."""
        reach = np.array(self._lookup_path(state, chain) + [0.0])  # P(>= j + 1 accepted)
        stop = np.append(1.0, reach[:-1]) - reach  # P(exactly j accepted), j = 0 .. chain
        return float(stop @ np.maximum(0.0, gain - np.arange(len(stop))))

    def _lookup_path(self, state: RequestState, n: int) -> list[float]:
        """P(the lookup nodes at depths 1 .. n all accepted), by n: the running product of
        P(lookup node at depth d + 1 accepted | its parent accepted), each the request's own
        with the decoder-wide rate as a prior worth two observations. In Python floats (the
        same operations as numpy's, in the same order: the same bits), once per request per
        step."""
        own, shared = state.lookup, self.lookup
        path, p = [], 1.0
        for a, t, sa, st in zip(own.accepted[:n], own.tried, shared.accepted, shared.tried):
            p *= (a + 2 * (sa / st)) / (t + 2)
            path.append(p)
        return path

    # -- values and selection --------------------------------------------------------------------
    def values(self, state: RequestState, tree: DraftTree) -> np.ndarray:
        """[n] P(node on the accepted path), non-increasing from parent to child."""
        n = len(tree)
        if n and _lookup_only(tree, state.chain_nodes):
            # its path values (a product of rates <= 1, never increasing)
            return np.array(self._lookup_path(state, n))
        v = np.zeros(n)
        if tree.scores is not None:
            scored = [i for i, s in enumerate(tree.scores) if s is not None]
            if scored:  # (lookup chains alone have none)
                v[scored] = self.scores.values(np.array([tree.scores[i] for i in scored]))
        if state.chain_nodes:
            path = np.array(self._lookup_path(state, len(state.chain_nodes)))
            v[state.chain_nodes] = np.maximum(v[state.chain_nodes], path)
        for i, p in enumerate(tree.parents):
            if p >= 0:
                v[i] = min(v[i], v[p])
        return v

    def select(self, batch: int, trees: list[DraftTree], values: list[np.ndarray],
               probes: list[bool], max_rows: int, ahead: list[float] | None = None,
               idle_ahead: float = 0.0) -> list[list[int]]:
        """Nodes to verify per tree (parents first), maximising the step's expected rate with
        no request falling behind plain decoding. `trees` are those of the requests with
        drafts, `ahead` their leads over plain decoding in tokens; the other batch - len(trees)
        requests have none, and the least lead among them is `idle_ahead`."""
        if not self.adaptive:
            return [list(range(len(t))) for t in trees]
        keep: list[list[int]] = [[] for _ in trees]
        ahead = np.zeros(len(trees)) if ahead is None else np.asarray(ahead, dtype=np.float64)
        idle = 1.0 + idle_ahead if len(trees) < batch else math.inf  # what the idle ones allow
        plain = self.cost.step_time(batch, batch)
        limit, rows = plain / (1 - self.fairness), 0  # what probes may bring the step to
        beat = batch / plain * (1 + MARGIN)  # the rate a selection must exceed
        order = None
        # a request without drafts advances one token either way: the step may cost no more
        # than a plain one, the fairness budget and its lead aside (see _worst_served)
        if self._may_pay(batch, values, max_rows, beat, limit * idle):
            # every node, best first: by value, then depth, request and index (one sort of arrays)
            sizes = [len(v) for v in values]
            value = np.concatenate(values).astype(np.float64, copy=False)
            owner = np.repeat(np.arange(len(values)), sizes)
            index = np.arange(len(value)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
            depth = np.fromiter(itertools.chain.from_iterable(t.depth for t in trees), np.int64, len(value))
            order = np.lexsort((index, owner, depth, -value))[:max(0, max_rows - batch)]
        if order is not None and len(order):
            taken, owner = value[order], owner[order]
            gained = batch + np.cumsum(taken)  # tokens after the first n nodes
            n_rows = batch + np.arange(1, len(order) + 1)
            times = self.cost.step_times(batch, n_rows)
            rates = gained / times
            worst = np.minimum(self._worst_served(taken.tolist(), owner.tolist(), ahead), idle)
            rates[worst < times / plain * (1 - self.fairness)] = 0.0
            best = int(np.argmax(rates))
            if rates[best] > beat:
                for b, i in zip(owner[:best + 1].tolist(), index[order[:best + 1]].tolist()):
                    keep[b].append(i)
                limit, rows = max(limit, times[best]), best + 1
        for b, probe in enumerate(probes):  # a request that has not verified for long probes,
            if probe and not keep[b] and len(trees[b]):  # within the others' slow-down budget
                if batch > 1 and self.cost.step_time(batch, batch + rows + 1) > limit:
                    break
                keep[b], rows = [0], rows + 1
        return keep

    def _may_pay(self, batch: int, values: list[np.ndarray], max_rows: int, threshold: float,
                 cap: float) -> bool:
        """Whether any count of nodes could beat `threshold` tokens per second in a step of at
        most `cap` seconds, in Python floats (most steps under load end here): for n in
        [lo, 2 lo) the rate is at most (batch + the 2 lo - 1 largest values) / t(batch, batch + lo)."""
        flat = sorted((x for v in values for x in v.tolist()), reverse=True)[:max(0, max_rows - batch)]
        total, lo, at = float(batch), 1, 0
        while lo <= len(flat):
            t = self.cost.step_time(batch, batch + lo)
            if t > cap:
                return False
            hi = min(2 * lo - 1, len(flat))
            total += sum(flat[at:hi])
            at = hi
            if total / t > threshold:
                return True
            lo *= 2
        return False

    @staticmethod
    def _worst_served(taken: list[float], owner: list[int], ahead: np.ndarray) -> np.ndarray:
        """[n] the least of 1 + lead + expected accepted tokens over the requests with drafts,
        after the first n nodes (each node's value in `taken`, its request in `owner`;
        in plain steps: each request's advance in this one, plus what it may give back). One
        pass in Python floats: each node raises its own request's sum only, so the least
        changes only when that request was the one least served (no nodes x requests table,
        512 x 64 at 64 in flight)."""
        base = (1.0 + ahead).tolist()
        gained = [0.0] * len(base)
        served = base.copy()
        least = min(served)
        at_least = served.count(least)
        out = []
        for x, r in zip(taken, owner):
            was = served[r]
            gained[r] += x
            served[r] = base[r] + gained[r]
            if was == least:
                at_least -= 1
                if not at_least:
                    least = min(served)
                    at_least = served.count(least)
            out.append(least)
        return np.array(out)

    def slowdown(self, batch: int, rows: int) -> float:
        """A step of `batch` requests verifying `rows` rows in plain steps of that batch."""
        return self.cost.step_time(batch, rows) / self.cost.step_time(batch, batch) if rows > batch else 1.0

    def advance(self, state: RequestState, emitted: int, slowdown: float) -> None:
        """A verified step: `emitted` tokens in `slowdown` plain steps' time (the step's
        prediction), into the request's lead over (1 - fairness) x plain decoding's pace: a
        plain step adds `fairness`, so the 5% (by default) a request may be slowed by is a
        budget over its life rather than a cap on every step. A request that fell behind starts
        again from none (it is then served as every request is in its first step)."""
        state.ahead = min(AHEAD_MAX, max(0.0, state.ahead + emitted - (1 - self.fairness) * slowdown))

    # -- learning --------------------------------------------------------------------------------
    def refused(self, state: RequestState, batch: int) -> None:
        """The proposer drafted for the request but none of it was worth verifying: a drafting
        step that gained nothing, for the request's gate and, under load (batch > 1), for what
        a new request starts from (alone, a refused tree costs only its drafting)."""
        self._count_drafting(state.gate, 0.0, batch > 1)

    def _count_drafting(self, gate: Gate, gained: float, for_new_requests: bool) -> None:
        """A drafting step's accepted tokens, into the request's gate and (for_new_requests)
        the average a new request's gate starts from."""
        gate.gain = 0.7 * gate.gain + 0.3 * gained
        if for_new_requests:
            self.gain = 0.95 * self.gain + 0.05 * gained

    def observe(self, state: RequestState, tree: DraftTree, path: list[int], chain_nodes: list[int]) -> None:
        """A verify result: `path` are the accepted nodes of `tree` (as verified)."""
        drafted_gain = drafted_rows = 0
        if _lookup_only(tree, chain_nodes):  # (most steps under load)
            # its accepted path is its first nodes, and each depth up to the first rejected one is seen
            for d in range(min(len(tree), len(path) + 1)):
                ok = d < len(path)
                state.lookup.observe(d, ok)
                self.lookup.observe(d, ok)
        else:
            on_path = set(path)
            reached = on_path | {-1}
            chain_depth = {node: d for d, node in enumerate(chain_nodes)}  # depth - 1 of each lookup node
            for i, p in enumerate(tree.parents):
                ok = i in on_path
                if tree.scores is not None and tree.scores[i] is not None:
                    self.scores.observe(tree.scores[i], ok)
                    drafted_rows += 1
                    drafted_gain += ok
                if i in chain_depth and p in reached:
                    state.lookup.observe(chain_depth[i], ok)
                    self.lookup.observe(chain_depth[i], ok)
        if state.drafted:
            self._count_drafting(state.gate, drafted_gain, True)
            state.gate.rows = 0.7 * state.gate.rows + 0.3 * drafted_rows
