"""Adaptive speculation length: draft only as far as it pays, per request.

Model. A request's drafts are accepted one after another with probability `alpha` each
(estimated per request from its own verify results, with exponential forgetting). With k
drafts a verify step emits on average E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens and
costs C(k) = 1 + overhead + k * r plain decode steps:
  * overhead: the extra time of a target step that verifies drafts over a plain decode step,
    flat in k (a forward over a few tokens costs about the same for 2 or 6 of them; on CPU
    it is the switch from matrix-vector to matrix-matrix products, measured at +60-80%
    here). It starts at the configured `verify_cost` and is then learned from the times
    of target decode steps with and without drafts, per batch size;
  * r: per draft token, a small verify share (`VERIFY_PER_TOKEN`) plus, for a draft model,
    the measured time of one draft step over the measured time of a target step.
The request gets the k in 0..K maximising E(k) / C(k) (0 when nothing beats a plain step).

When that is 0 the request stops speculating; it probes again with one draft after
`probe_interval` steps, so a request whose text becomes predictable later (a summary that
starts quoting) can return to speculation. n-gram misses cost nothing (no match, no draft)
and do not count as rejections.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from specserve.request import Request

VERIFY_PER_TOKEN = 0.02  # verify cost of one more draft token, relative to a plain step


@dataclass
class _Acceptance:
    accepted: float = 1.0  # prior: one accepted and one rejected draft (alpha = 0.5)
    rejected: float = 1.0
    idle_steps: int = 0

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class AdaptiveLength:
    def __init__(self, max_drafts: int, enabled: bool = True, verify_cost: float = 0.1,
                 decay: float = 0.8, probe_interval: int = 16) -> None:
        self.max_drafts = max_drafts
        self.enabled = enabled
        self.verify_cost = verify_cost  # the overhead above, learned
        self.decay = decay
        self.probe_interval = probe_interval
        self.draft_cost = 0.0  # one draft step / one target step (measured; 0 for n-gram)
        self._plain_s: dict[int, float] = {}  # batch size -> time of a decode step without drafts
        self._acc: weakref.WeakKeyDictionary[Request, _Acceptance] = weakref.WeakKeyDictionary()

    def observe(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """A verify result: the first num_accepted of num_drafts drafts were accepted."""
        a = self._acc.setdefault(req, _Acceptance())
        a.accepted = a.accepted * self.decay + num_accepted
        a.rejected = a.rejected * self.decay + (1 if num_accepted < num_drafts else 0)

    def observe_costs(self, target_step_s: float, draft_step_s: float) -> None:
        if target_step_s > 0:
            ratio = draft_step_s / target_step_s
            self.draft_cost = ratio if self.draft_cost == 0 else 0.8 * self.draft_cost + 0.2 * ratio

    def observe_target_step(self, seconds: float, num_requests: int, num_drafts: int,
                            num_tokens: int) -> None:
        """Learn the verify overhead from target step times: decode steps without drafts give
        the plain step time of a batch size, steps with drafts the overhead over it."""
        if num_tokens != num_requests + num_drafts:
            return  # a prefill chunk is in the step: not comparable
        plain = self._plain_s.get(num_requests)
        if num_drafts == 0:
            self._plain_s[num_requests] = seconds if plain is None else 0.8 * plain + 0.2 * seconds
        elif plain:
            extra = seconds / plain - 1.0 - VERIFY_PER_TOKEN * num_drafts
            self.verify_cost = min(3.0, max(0.0, 0.8 * self.verify_cost + 0.2 * extra))

    def num_drafts(self, req: Request) -> int:
        if not self.enabled:
            return self.max_drafts
        a = self._acc.setdefault(req, _Acceptance())
        best = best_length(a.alpha, self.max_drafts, VERIFY_PER_TOKEN + self.draft_cost,
                           self.verify_cost)
        if best > 0:
            a.idle_steps = 0
            return best
        a.idle_steps += 1
        if a.idle_steps >= self.probe_interval:
            a.idle_steps = 0
            return 1
        return 0

    def alpha(self, req: Request) -> float:
        return self._acc.setdefault(req, _Acceptance()).alpha


def best_length(alpha: float, max_drafts: int, cost_per_draft: float, overhead: float = 0.0) -> int:
    """argmax over k in [0, max_drafts] of expected tokens per step / the step's cost."""
    best, best_rate = 0, 1.0
    for k in range(1, max_drafts + 1):
        expected = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
        rate = expected / (1 + overhead + k * cost_per_draft)
        if rate > best_rate * 1.02:  # ties go to the shorter draft
            best, best_rate = k, rate
    return best


@dataclass
class _TreeState:
    tokens: float  # tokens emitted per tree step (EMA)
    idle_steps: int = 0


class TreeGate:
    """Per-request on/off switch for tree speculation (EAGLE, Medusa).

    A tree step costs `cost` plain decode steps (drafting with the head plus the wider target
    forward); it pays when the tokens it emits per step (an EMA per request) exceed that.
    `cost` starts at `prior_cost` and is learned from step times: decode-only steps with and
    without trees, per batch size. A request whose trees do not pay stops drafting and probes
    again after `probe_interval` plain steps (its head keeps reading the target's features, so
    a probe drafts from the current position at once).
    """

    def __init__(self, enabled: bool = True, prior_cost: float = 1.3, decay: float = 0.7,
                 probe_interval: int = 16) -> None:
        self.enabled = enabled
        self.cost = prior_cost
        self.decay = decay
        self.probe_interval = probe_interval
        self._step_s: dict[tuple[int, bool], float] = {}  # (batch size, any tree) -> seconds
        self._req: weakref.WeakKeyDictionary[Request, _TreeState] = weakref.WeakKeyDictionary()

    def _state(self, req: Request) -> _TreeState:
        return self._req.setdefault(req, _TreeState(tokens=2 * self.cost))  # optimistic start

    def observe(self, req: Request, emitted: int) -> None:
        s = self._state(req)
        s.tokens = self.decay * s.tokens + (1 - self.decay) * emitted

    def observe_step(self, seconds: float, num_requests: int, with_trees: bool) -> None:
        key = (num_requests, with_trees)
        old = self._step_s.get(key)
        self._step_s[key] = seconds if old is None else 0.8 * old + 0.2 * seconds
        plain, tree = self._step_s.get((num_requests, False)), self._step_s.get((num_requests, True))
        if plain and tree:
            self.cost = min(4.0, max(1.0, tree / plain))

    def active(self, req: Request) -> bool:
        if not self.enabled:
            return True
        s = self._state(req)
        if s.tokens > self.cost:
            s.idle_steps = 0
            return True
        s.idle_steps += 1
        if s.idle_steps >= self.probe_interval:
            s.idle_steps = 0
            s.tokens = self.cost * 1.05  # one probe: its result decides what comes next
            return True
        return False
