"""The measured cost of a decode step on the machine the engine runs on (the reasoning and its
measurements: docs/speculation.md, "The cost model and the policy").

`StepCostModel` predicts the seconds of a decode-only target step of B requests verifying R
rows (B plus every draft node): t(B, R) = plain(B) [+ rows(R) - rows(B) + (R - B) extra(B)
when R > B], rows(R) measured at engine start and refined by live steps of one request,
plain(B) measured at start and by live plain steps, extra(B) the slope of live steps' time
over their draft rows (a regression, so that a drift of the whole step is not charged to
rows). A step with drafts is always predicted against the plain step of its own B.
`Realized` checks the model's decisions against the wall clock, per batch-size bucket and kind
of step (with the per-request proposer, or a tree method's lookup chains alone), and switches
a kind off where it measures slower (probing again at doubling intervals).
`Curve` is the table behind both and behind drafting costs. No number here is a constant true
of one CPU: every one comes from a measurement.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

CALIBRATION_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
CALIBRATION_CONTEXT = 128
PLAIN_EVERY = 16  # steps with drafts at a batch size between two plain ones (plain(B) refresh)
PROBE_AFTER, PROBE_MAX, PROBE_RUN = 32, 128, 6  # plain steps before a speculative probe run; its steps
PROBE_BUDGET, PROBE_LONGEST = 0.01, 1024  # what probe runs may cost (a share of plain decoding's time,
# by the loss last measured), and the most plain steps that stretches the wait to
MIN_SAMPLES = 8  # speculative samples at a batch size before it can be judged slower
QUICK_SAMPLES, QUICK_RATIO = 3, 2.0  # ... or this many, where a kind measures over this many times
# plain's seconds per token (a GPU's graph-replayed step against a step's host work and draft
# passes: 2-4x at 64 in flight on an H100); a CPU's one stalled step in three does not get there;
# or where its samples so far are conclusive (`Realized._conclusive`)
PLAIN_WEIGHT = 0.2  # an EMA's weight of each new plain sample (its mean: as good as ~9 samples) ...
PLAIN_CLIP = 0.1  # ... each within this share of the mean: one stalled step 30% slow moved a bucket's
# plain rate by 6% (a speculative rate, decayed sums of ~20 steps, by 1.5%): enough for steps with
# drafts a few percent slower than plain to measure faster until later plain samples undid it
T_95 = (6.31, 2.92, 2.35, 2.13, 2.02, 1.94, 1.89, 1.86)  # Student's t, one-sided 95%, by degrees of freedom
PLAIN_SAMPLE_EVERY = 64  # steps with speculation between two plain samples of Realized ...
PLAIN_SAMPLES_FIRST = 4  # ... but a fourth as many until a bucket has this many plain samples
FIT_DECAY = 0.95  # per live step of a batch size: the weight of older steps in extra(B)'s fit
FIT_RIDGE = 4.0  # rows^2 of spread in draft rows before a batch size's own slope outweighs its prior
_CALIBRATED: dict[tuple, tuple] = {}  # per process: engines of one model share the measurement


class Curve:
    """A non-decreasing function of a positive count, piecewise linear between points."""

    def __init__(self, points: dict[int, float] | None = None, weight: float = 0.2) -> None:
        self.x, self.y = [], []  # the points: x ascending, y non-decreasing
        self.weight = weight
        for x, y in sorted((points or {}).items()):
            self._set(x, y)

    def __call__(self, x: float) -> float:
        if not self.x:
            return 0.0
        i = bisect.bisect_left(self.x, x)
        if i < len(self.x) and self.x[i] == x:
            return self.y[i]
        if i == 0 or len(self.x) == 1:  # below the first point (or a single one): through the origin
            return self.y[0] * x / self.x[0]
        if i == len(self.x):  # past the last point: its slope
            slope = (self.y[-1] - self.y[-2]) / (self.x[-1] - self.x[-2])
            return self.y[-1] + max(0.0, slope) * (x - self.x[-1])
        x0, x1, y0, y1 = self.x[i - 1], self.x[i], self.y[i - 1], self.y[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def update(self, x: int, value: float) -> None:
        """Blend a measurement at x into the curve (a new point starts from the prediction)."""
        value = max(0.0, min(value, 3 * self(x) if self.x else value))  # a stall is not the machine
        self._set(x, value if not self.x else (1 - self.weight) * self(x) + self.weight * value)

    def many(self, xs: np.ndarray) -> np.ndarray:
        """The curve at every x of an array (vectorised __call__ for x >= the first point)."""
        x, y = np.asarray(self.x, dtype=np.float64), np.asarray(self.y, dtype=np.float64)
        out = np.interp(xs, x, y)
        if len(x) > 1:
            slope = max(0.0, (y[-1] - y[-2]) / (x[-1] - x[-2]))
            out = np.where(xs > x[-1], y[-1] + slope * (xs - x[-1]), out)
        return out

    def _set(self, x: int, y: float) -> None:
        i = bisect.bisect_left(self.x, x)
        if i < len(self.x) and self.x[i] == x:
            self.y[i] = y
        else:
            self.x.insert(i, x)
            self.y.insert(i, y)
        for j in range(i + 1, len(self.y)):  # keep it non-decreasing around the new value
            self.y[j] = max(self.y[j], y)
        for j in range(i):
            self.y[j] = min(self.y[j], y)


class StepCostModel:
    def __init__(self, rows: dict[int, float], per_request: float = 0.0,
                 plain: dict[int, float] | None = None) -> None:
        """rows: seconds of a step of one request computing R rows, by R; plain: seconds of
        plain steps of B requests, by B, as measured at start; per_request: the prior extra
        seconds of each further request past the largest B measured."""
        self.rows = Curve(rows)
        self.per_request = max(0.0, per_request)
        self._plain: dict[int, list[float]] = {b: [t, 1] for b, t in (plain or {}).items() if b > 1}
        self._fit: dict[int, list[float]] = {}  # batch -> decayed sums [w, x, y, xx, xy] (see observe)
        self._extra: dict[int, float] = {}  # extra(B) as last computed: read many times per step, fitted once
        self._since_plain: dict[int, int] = {}  # batch -> its steps with drafts since its last plain one

    def plain_time(self, batch: int) -> float:
        """Seconds of a plain step of `batch` requests: measured at that batch size, else
        interpolated between the nearest ones measured (one request: the rows curve)."""
        if batch in self._plain:
            return self._plain[batch][0]
        lo = max((b for b in self._plain if b < batch), default=1)
        hi = min((b for b in self._plain if b > batch), default=0)
        t_lo = self._plain[lo][0] if lo > 1 else self.rows(1)
        if not hi:
            return t_lo + self.rows(batch) - self.rows(lo) + self.per_request * (batch - lo)
        return t_lo + (self._plain[hi][0] - t_lo) * (batch - lo) / (hi - lo)

    def extra(self, batch: int) -> float:
        """Seconds each draft row adds at this batch size beyond what the rows curve says
        (longer contexts than at calibration, attention of draft rows), never less than
        nothing: the slope of its live steps' time over their draft rows, shrunk towards the
        nearest other batch size's slope (or none) until its steps spread over enough rows."""
        if batch == 1 or not self._fit:
            return 0.0
        found = self._extra.get(batch)
        if found is None:
            others = [b for b in self._fit if b != batch]
            prior = self._slope(min(others, key=lambda b: (abs(b - batch), -b)), 0.0) if others else 0.0
            found = self._extra[batch] = self._slope(batch, prior) if batch in self._fit else prior
        return found

    def _slope(self, batch: int, prior: float) -> float:
        w, x, y, xx, xy = self._fit[batch]
        spread, co = xx - x * x / w, xy - x * y / w
        return max(0.0, (co + FIT_RIDGE * prior) / (spread + FIT_RIDGE))

    def step_time(self, batch: int, rows: int) -> float:
        """Predicted seconds of a decode step of `batch` requests verifying rows - batch drafts
        (scalar: called per request per step, where a numpy array costs more than the sum)."""
        if rows <= batch:
            return self.plain_time(batch)
        return self.plain_time(batch) + self.rows(rows) - self.rows(batch) + self.extra(batch) * (rows - batch)

    def step_times(self, batch: int, rows: np.ndarray) -> np.ndarray:
        """step_time(batch, r) for every r > batch of an array."""
        return self.plain_time(batch) + self.rows.many(rows) - self.rows(batch) + self.extra(batch) * (rows - batch)

    def observe(self, batch: int, rows: int, seconds: float) -> None:
        """A live decode-only step. One request: the rows curve itself. Several: plain steps
        measure plain(B) (the prior counted as one step, then the mean of the steps, then an
        EMA: a batch size met for a few steps, a load's tail, is judged by them); every step
        is a point (x = draft rows, y = seconds less the rows curve's part) of a decayed
        least-squares line whose slope is extra(B). Its intercept absorbs what moves the
        whole step (contexts growing between plain samples, the load's mix), which a per-row
        average over steps of one or two draft rows would charge to the rows many times over."""
        if batch == 1:
            self.rows.update(rows, seconds)
            return
        predicted = self.step_time(batch, rows)
        seconds = min(seconds, 3 * predicted)  # a stall is not the machine
        if rows <= batch:
            mean, n = self._plain.get(batch, (predicted, 1))
            w = max(0.2, 1 / (n + 1))
            self._plain[batch], self._since_plain[batch] = [(1 - w) * mean + w * seconds, n + 1], 0
        else:
            self._since_plain[batch] = self._since_plain.get(batch, 0) + 1
        x = float(max(0, rows - batch))
        y = seconds - (self.rows(rows) - self.rows(batch) if x else 0.0)
        fit = [FIT_DECAY * v for v in self._fit.get(batch, (0.0,) * 5)]
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            fit[i] += v
        self._fit[batch] = fit
        self._extra.clear()  # (every batch size's prior may have moved)

    def plain_due(self, batch: int) -> bool:
        """Whether the next step of `batch` requests should be plain, to measure plain(B) at
        today's contexts: after PLAIN_EVERY steps with drafts at B (or at once, when B has
        never run plain). Without it plain(B) keeps the calibration's prior, which is off by
        as much as speculation gains at high load. A yes counts as the plain step taken: one
        that turns out to hold a prefill chunk measures nothing, and the next chance comes
        after PLAIN_EVERY more steps with drafts at B, so that a batch size met only just
        before a request arrives (one finished, its successor comes in with a prefill) still
        speculates, its plain(B) interpolated meanwhile."""
        if batch <= 1 or self._since_plain.get(batch, PLAIN_EVERY) < PLAIN_EVERY:
            return False
        self._since_plain[batch] = 0
        return True

    def row_price(self, batch: int, rows: int) -> float:
        """Seconds per row of adding `rows` draft rows to a plain step of `batch` requests."""
        return (self.step_time(batch, batch + rows) - self.step_time(batch, batch)) / max(1, rows)

    @staticmethod
    def measure(runner, kv, max_rows: int) -> "StepCostModel":
        """Time target forwards of 1 .. max_rows rows (one request) and of plain steps of 4 and
        16 requests, each the least of 3 after one warm-up forward. A few seconds; cached per
        process."""
        key = (repr(runner.arch), str(runner.dtype), str(runner.device), torch.get_num_threads(),
               runner.block_size, getattr(runner, "tp_size", 1),
               getattr(runner, "steps", None) is not None,  # (the compiled / graph step, or eager)
               getattr(runner, "batch_invariant", False), getattr(runner, "quantization", "none"))
        if key not in _CALIBRATED:
            _CALIBRATED[key] = StepCostModel._calibrate(runner, kv, max_rows)
        return StepCostModel(*_CALIBRATED[key])

    @staticmethod
    def _calibrate(runner, kv, max_rows: int) -> tuple[dict[int, float], float, dict[int, float]]:
        sizes = [r for r in CALIBRATION_ROWS if r <= max_rows]
        start = time.perf_counter()
        print(f"[specserve] measuring step costs on {runner.device} (rows {sizes[0]}..{sizes[-1]}) ...",
              end="", flush=True)
        _time_step(runner, kv, 1, sizes[-1], reps=1)  # warm-up: first touches of the cache
        rows = {r: t for r in sizes if (t := _time_step(runner, kv, 1, r)) is not None}
        plain = {b: t for b in (4, 16) if (t := _time_step(runner, kv, b, 1)) is not None}
        if not rows:
            raise ValueError("speculative_config: the KV cache is too small to measure a step")
        model = StepCostModel(rows)
        extra = [(t - model.rows(b)) / (b - 1) for b, t in plain.items()]
        model.per_request = max(0.0, sum(extra) / len(extra)) if extra else 0.0
        most = max(rows)
        print(f" done in {time.perf_counter() - start:.1f} s: one row {1e3 * rows[1]:.1f} ms, "
              f"{most} rows {1e3 * rows[most]:.1f} ms, "
              f"+{1e3 * model.per_request:.2f} ms per request", flush=True)
        return rows, model.per_request, plain


@dataclass
class _Off:
    """A batch-size bucket where speculation measured slower: its probe schedule."""

    waited: int = 0  # plain steps since the last probe run
    interval: int = PROBE_AFTER  # plain steps before the next one
    run: int = 0  # probe steps still to go


PLAIN, SPEC, LOOKUP_ONLY = 0, 1, 2  # a step's kind (Realized's arms): no drafts; every proposer's
# drafts; only the lookup chains (a tree method whose per-request proposer measured slower)
_SPECULATIVE = (SPEC, LOOKUP_ONLY)


class Realized:
    """Whether steps with speculation are faster than plain steps, as measured end to end. A
    bucket's speculative rate is a ratio of decayed sums (seconds relative to the model's plain
    step time, over tokens): a mean of per-step ratios would count a one-token step in full.
    The sums decay at every step of the bucket, so a probe run outweighs an old verdict.
    Beside them the same decayed sums of squares give each step's spread around the rate, so
    that a kind whose first samples are conclusively slower is judged on those rather than
    after MIN_SAMPLES (`_conclusive`: steps of 16 requests 10% slower per token than plain,
    spreading by 3%, are judged on 6; steps alike, on 3).

    Two kinds of speculative step are judged apart: SPEC (every proposer) and LOOKUP_ONLY (the
    lookup chains of a tree method without its per-request proposer, e.g. EAGLE's head). Where
    SPEC measures slower, a decoder that has both falls back to LOOKUP_ONLY rather than to
    plain steps (prompt lookup costs no model time, and pays on text the head does not suit),
    and to plain steps where that measures slower too; each kind keeps its own verdict and
    probes."""

    def __init__(self, margin: float = 0.02, decay: float = 0.95) -> None:
        self.margin = margin  # speculation must beat plain by this much to stay on
        self.decay = decay
        self.plain: dict[int, float] = {}  # bucket -> relative seconds per token, plain steps (`observe`)
        # (bucket, kind) -> decayed sums [relative seconds s, tokens per request t, steps, s^2, s t, t^2]
        self.spec: dict[tuple[int, int], list[float]] = {}
        self.count: dict[tuple[int, int], int] = {}  # (bucket, kind) -> steps observed
        self.off: dict[tuple[int, int], _Off] = {}
        self.since_plain: dict[int, int] = {}
        self.free: frozenset[int] = frozenset()  # kinds whose drafts cost no model time (see speculate)

    @staticmethod
    def bucket(batch: int) -> int:
        return batch if batch <= 4 else 100 + round(2 * math.log2(batch))  # (a numpy scalar costs more)

    def observe(self, batch: int, kind: int, seconds: float, tokens: int, plain_time: float) -> None:
        """A whole decode step of `batch` requests of `kind` (PLAIN, SPEC, LOOKUP_ONLY; a bool:
        SPEC or PLAIN) emitting `tokens`; plain_time: the model's prediction of a plain step of
        that batch."""
        b, kind = self.bucket(batch), int(kind)
        n = self.count[(b, kind)] = self.count.get((b, kind), 0) + 1
        self._scale(b, self.decay)
        if kind:
            sums = self.spec.setdefault((b, kind), [0.0] * 6)
            s, t = seconds / plain_time, tokens / batch
            for i, v in enumerate((s, t, 1.0, s * s, s * t, t * t)):
                sums[i] += v
        else:  # the samples' mean, then an EMA of samples within PLAIN_CLIP of it
            value, mean = seconds * batch / max(1, tokens) / plain_time, self.plain.get(b, 0.0)
            if n > PLAIN_SAMPLES_FIRST:
                value = min(max(value, (1 - PLAIN_CLIP) * mean), (1 + PLAIN_CLIP) * mean)
            w = max(PLAIN_WEIGHT, 1 / n)
            self.plain[b] = (1 - w) * mean + w * value
        self.since_plain[b] = self.since_plain.get(b, 0) + 1 if kind else 0

    def new_requests(self, count: int, batch: int) -> None:
        """`count` of the `batch` requests about to decode are new to speculation. The bucket's
        verdicts were measured on other requests: where the new ones are at least half of the
        batch (every new request at batch 1), the old evidence counts for the share that stayed,
        a verdict of slower waits for MIN_SAMPLES steps of the new batch (its first, which
        re-warm the proposer, cost more than the rest) and a kind measured slower probes at
        once; so a request whose text speculation suits does not decode plainly for up to
        PROBE_MAX steps because the one before it did not."""
        share = count / batch
        if share < 0.5:
            return
        b = self.bucket(batch)
        self._scale(b, 1 - share)
        for arm in _SPECULATIVE:
            if (b, arm) in self.count:  # MIN_SAMPLES of the new requests before a verdict of slower
                self.count[(b, arm)] = int(self.count[(b, arm)] * (1 - share))
            off = self.off.get((b, arm))
            if off is not None:
                off.waited, off.interval, off.run = 0, PROBE_AFTER, PROBE_RUN

    def _scale(self, b: int, factor: float) -> None:
        """Both speculative kinds' sums of bucket b times `factor`."""
        for arm in _SPECULATIVE:
            sums = self.spec.get((b, arm))
            if sums is not None:
                sums[:] = [factor * v for v in sums]

    def rate(self, batch: int, kind: int = SPEC) -> float | None:
        """The bucket's measured relative seconds per token in steps of `kind` (None: no sample)."""
        seconds, tokens = self.spec.get((self.bucket(batch), kind), (0.0, 0.0))[:2]
        return seconds / tokens if tokens > 0 else None

    def speculate(self, batch: int, fallback: bool = False) -> int:
        """The kind of the next step of `batch` requests: PLAIN, SPEC, or (with `fallback`: the
        decoder has a lookup beside a per-request proposer) LOOKUP_ONLY where SPEC measured
        slower and the lookup chains alone have not.

        Steps whose drafts cost no model time (`free`: those of prompt lookup or suffix
        decoding) are never judged at batch 1, and so take no plain samples there: at batch 1
        the policy values the step's one tree from the request's own acceptance before
        verifying it, and a step without drafts costs a plain step and the lookup. A verdict of
        slower, over the ~20 steps the sums remember, switched such decoding off for
        PROBE_AFTER steps just as a stretch of new text gave way to one that repeats the
        context (agentic turns at batch 1: 46-230 of ~600 steps judged plain, 4-7% of the
        speed-up lost; nothing gained on Spec-Bench's questions). EAGLE's lookup chains alone
        (LOOKUP_ONLY) stay judged: measured no faster unjudged."""
        b = self.bucket(batch)
        if b == 1 and SPEC in self.free:
            return SPEC
        every = PLAIN_SAMPLE_EVERY // (4 if self.count.get((b, PLAIN), 0) < PLAIN_SAMPLES_FIRST else 1)
        if self.since_plain.get(b, every) >= every:
            # measure a plain step (taken: a step that turns out to hold a prefill chunk is no
            # sample, and the bucket is measured against the model's plain step until one is);
            # the first few sooner: one sample (a 10% outlier on a noisy machine) would stand
            # for plain's rate for 64 steps with speculation
            self.since_plain[b] = 0
            return PLAIN
        plain = self.plain.get(b, 1.0)
        if self._on(b, SPEC, plain):
            return SPEC
        return LOOKUP_ONLY if fallback and self._on(b, LOOKUP_ONLY, plain) else PLAIN

    def _on(self, b: int, kind: int, plain: float) -> bool:
        """Whether steps of `kind` should run in bucket b: not yet judged, judged faster than
        plain, or a probe run's turn. A kind measured far slower (QUICK_RATIO x plain per token
        and more) is judged after QUICK_SAMPLES steps, waits as long as its probes can afford
        before the first one, and probes in runs of QUICK_SAMPLES + 1 steps: where a step with
        drafts costs several plain steps, eight samples of it and a run of six every 32 steps
        would cost more than a short load's whole gain could repay. A batch size with no samples
        of the kind starts from a smaller one's far verdict (`_inherited`)."""
        seconds, tokens = self.spec.get((b, kind), (0.0, 0.0))[:2]
        if tokens > 0:
            ratio = seconds / tokens / max(plain, 1e-12)
            far = ratio > QUICK_RATIO
            judged = (self.count[(b, kind)] >= (QUICK_SAMPLES if far else MIN_SAMPLES)
                      or self._conclusive(b, kind, ratio))
        else:  # no samples here (or none of this batch's requests): a smaller batch's far verdict
            ratio, far, judged = self._inherited(b, kind), True, True
        if ratio * (1 + self.margin) <= 1 or not judged:
            self.off.pop((b, kind), None)
            return True
        off = self.off.get((b, kind))
        if off is None:
            off = self.off[(b, kind)] = _Off(interval=max(PROBE_AFTER, self._affordable(ratio)) if far else PROBE_AFTER)
        if off.run:  # inside a probe run
            off.run -= 1
            return True
        off.waited += 1
        if off.waited >= off.interval:  # start a probe run (its first step re-warms the proposer)
            off.waited, off.interval = 0, max(min(PROBE_MAX, 2 * off.interval), self._affordable(ratio))
            off.run = (QUICK_SAMPLES + 1 if far else PROBE_RUN) - 1
            return True
        return False

    def _conclusive(self, b: int, kind: int, ratio: float) -> bool:
        """Whether the QUICK_SAMPLES or more samples of `kind` in bucket b say, with 95%
        confidence (Student's t on their spread), that it does not beat plain by the margin.
        The rate is a ratio of sums, so its spread is that of each step's seconds around rate
        x its tokens; plain's mean is as uncertain as its samples (PLAIN_WEIGHT's EMA: ~9 at
        most; the model's prediction before the first counts as one), each spread as widely
        as the speculative steps' (the wider: drafting and acceptance vary). Speculation that
        pays is never judged here: the test only ever ends a losing kind's samples early. Only
        above 4 requests: a step's time and tokens there are many requests' average, while at
        1-4 a request's first steps (the head's first pass, an answer's opening) are not its
        later ones, and the steps are far from alike (at batch 1 on a Zen 4 it judged the head
        off after 3-5 samples where MIN_SAMPLES waited for it to pay)."""
        n = self.count[(b, kind)]
        if b <= 100 or n < QUICK_SAMPLES or n - 1 > len(T_95) or ratio * (1 + self.margin) <= 1:
            return False
        s, t, w, ss, st, tt = self.spec[(b, kind)]
        rate = s / t
        spread = max(0.0, ss - 2 * rate * st + rate * rate * tt) / w * n / (n - 1)  # per step, seconds^2
        plain_n = min(self.count.get((b, PLAIN), 0), round(2 / PLAIN_WEIGHT - 1)) or 1
        relative = math.sqrt(spread * (1 / n + 1 / plain_n)) / (t / w) / rate  # of ratio, per unit
        return ratio * (1 - T_95[n - 2] * relative) * (1 + self.margin) > 1

    def _inherited(self, b: int, kind: int) -> float:
        """The far verdict a bucket with no samples of `kind` starts from: the ratio measured at
        the nearest smaller batch size above 4 where the kind was judged, if it was far slower
        there (else 0: not judged). On a GPU a step's host work grows with its requests while
        a graph-replayed forward barely does, so a kind far slower at 16 in flight is slower
        at 64, and a wave of 64 new requests would otherwise pay its samples again; on a CPU
        no kind is far slower, and nothing is inherited."""
        donors = [k for (k, arm) in self.spec if arm == kind and 100 < k < b
                  and self.count[(k, arm)] >= QUICK_SAMPLES and self.spec[(k, arm)][1] > 0]
        if b <= 100 or not donors:
            return 0.0
        k = max(donors)
        seconds, tokens = self.spec[(k, kind)][:2]
        ratio = seconds / tokens / max(self.plain.get(k, 1.0), 1e-12)
        return ratio if ratio > QUICK_RATIO else 0.0

    def quiet(self, batch: int, steps: int) -> bool:
        """Whether steps with the per-request proposer (SPEC) measured slower at this batch size
        and will not run in its next `steps` steps: no probe run under way, the next one further
        off (a new batch probes at once, `new_requests`: this turns False then). The decoder
        shows such a proposer no decode rows' features meanwhile (it needs `steps` of them to
        draft again as it would have: what EAGLE's catch-up reads)."""
        off = self.off.get((self.bucket(batch), SPEC))
        return off is not None and not off.run and off.interval - off.waited > steps

    @staticmethod
    def _affordable(ratio: float) -> int:
        """Plain steps between probe runs that keep their cost within PROBE_BUDGET of plain
        decoding's time, where speculation measured `ratio` x plain's seconds per token: a
        run's extra time is about PROBE_RUN x (ratio - 1) plain steps. Where drafting costs
        more than a forward (a GPU step replayed from a graph, the head's passes not: 4.3 ms
        against 2.6 ms at 16 in flight on an H200) runs at 2.7x plain every 128 steps would
        cost 8% of the time; at 1.1x (a CPU under load) the doubling schedule alone keeps it
        under 1%."""
        return min(PROBE_LONGEST, math.ceil(PROBE_RUN * max(0.0, ratio - 1) / PROBE_BUDGET))


def _time_step(runner, kv, num_requests: int, rows_each: int, reps: int = 3) -> float | None:
    """The least seconds over `reps` runs of a target step of `num_requests` requests, each
    computing `rows_each` rows after CALIBRATION_CONTEXT tokens (the KV cache holds whatever it
    holds: only time is read); None when the cache or the context cannot hold them."""
    from specserve.request import Request, SamplingParams
    from specserve.scheduler.scheduler import SchedulerOutput

    room = kv.num_free_blocks * kv.block_size // max(1, num_requests) - kv.block_size
    # a small cache or a short context: shorter contexts (positions stay inside the model's)
    ctx = min(CALIBRATION_CONTEXT, room - rows_each, runner.max_model_len - rows_each)
    reqs = []
    for i in range(num_requests):
        req = Request(f"calibration-{i}", [1] * (ctx + rows_each), SamplingParams(), set(), 0)
        if not kv.can_allocate(req, ctx + rows_each):
            break
        kv.allocate(req, ctx + rows_each)
        req.num_computed_tokens = ctx
        reqs.append(req)
    try:
        if len(reqs) < num_requests or ctx < 0:
            return None
        sched = SchedulerOutput(reqs, [rows_each] * len(reqs), [0] * len(reqs))
        times = []
        for _ in range(reps):
            _sync(runner.device)
            t0 = time.perf_counter()
            runner.execute(sched)
            _sync(runner.device)
            times.append(time.perf_counter() - t0)
        return min(times)  # (noise on a shared machine only adds time)
    finally:
        for req in reqs:
            kv.free(req)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_clock(device: torch.device) -> float:
    """perf_counter once the device's queued work has finished: on CUDA the clock of a step
    timer reads when the work is done, not when its kernels were launched (the host runs ahead
    of the GPU); on a CPU, where work is done when its call returns, just perf_counter."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
