"""Continuous batching at iteration level, FCFS, with a token budget per step.

One rule covers prefill, chunked prefill, prefix hits, decode and draft verification: each
running request's computed length catches up with its known length (committed tokens plus
drafts), as far as the step's token budget allows. Slots for every scheduled token, drafts
included, are reserved before the step runs, so the forward pass never allocates. When the
pool runs dry the newest running request is preempted (its blocks freed, recomputed later
from its committed tokens), so a full pool slows requests down but never fails or loses
output.

Waiting requests sit in a WaitingQueue: FIFO with preempted requests put back at its head,
and removal from anywhere in O(1) (an aborted request's entry is cleared in place and dropped
once it reaches the head), so a client that disconnects with 256,000 queued sequences costs
the engine thread 256,000 constant-time removals, not a scan of the queue for each.

The scheduler does not sample, detokenise or check stop conditions: see Engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from specserve.config import SchedulerConfig
from specserve.kv_cache.manager import KVCacheManager
from specserve.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)  # scheduled, in batch order
    num_tokens: list[int] = field(default_factory=list)  # new tokens computed per request
    num_drafts: list[int] = field(default_factory=list)  # of which trailing draft tokens
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def decode_only(self) -> bool:
        """Every request computes one committed token plus its drafts (no prefill chunk)."""
        return self.total_tokens == len(self.requests) + sum(self.num_drafts)

    def __len__(self) -> int:
        return len(self.requests)


class WaitingQueue:
    """Requests waiting for admission, oldest first, with O(1) removal of any of them.

    Each request in the queue has one entry, a one-item list [request]; removing it empties
    the entry in place (dropping the request at once) and the empty entry is skipped and
    discarded when it reaches the head, or swept out when empty entries outnumber live ones
    (amortised O(1) per removal). len(), bool() and iteration see live requests only.
    """

    _SWEEP_MIN = 1024  # empty entries tolerated regardless of the live count

    def __init__(self) -> None:
        self._entries: deque[list[Request | None]] = deque()
        self._entry_of: dict[Request, list[Request | None]] = {}  # live requests (identity keys)

    def __len__(self) -> int:
        return len(self._entry_of)

    def __bool__(self) -> bool:
        return bool(self._entry_of)

    def __contains__(self, req: Request) -> bool:
        return req in self._entry_of

    def __iter__(self) -> Iterator[Request]:
        return (entry[0] for entry in list(self._entries) if entry[0] is not None)

    def append(self, req: Request) -> None:
        self._entries.append(self._new_entry(req))

    def appendleft(self, req: Request) -> None:
        self._entries.appendleft(self._new_entry(req))

    def _new_entry(self, req: Request) -> list[Request | None]:
        assert req not in self._entry_of, f"{req} is already waiting"
        entry = self._entry_of[req] = [req]
        return entry

    def peek(self) -> Request | None:
        """The oldest live request (None if there is none), dropping empty entries before it."""
        entries = self._entries
        while entries:
            req = entries[0][0]
            if req is not None:
                return req
            entries.popleft()
        return None

    def popleft(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty WaitingQueue")
        del self._entry_of[req]
        self._entries.popleft()
        return req

    def remove(self, req: Request) -> bool:
        """Take req out wherever it is; False if it was not waiting."""
        entry = self._entry_of.pop(req, None)
        if entry is None:
            return False
        entry[0] = None
        if len(self._entries) > 2 * len(self._entry_of) + self._SWEEP_MIN:
            self._entries = deque(e for e in self._entries if e[0] is not None)
        return True


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        """Live waiting requests (removed ones excluded): what stats report."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take a finished or aborted request out and return its blocks to the pool.

        O(1) for a waiting request; a running one costs one scan of at most max_num_seqs.
        """
        if not self.waiting.remove(req):
            try:
                self.running.remove(req)
            except ValueError:  # in neither: already taken out
                pass
        self.kv.free(req)

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self, only: list[Request] | None = None) -> SchedulerOutput:
        """The next step's batch. `only`: schedule just these requests, the others stay where
        they are (the engine runs a group alone while it traces a failed step)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        allowed = None if only is None else set(only)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if allowed is not None and req not in allowed:
                i += 1
                continue
            num_new, num_drafts = self._tokens_to_compute(req, budget)
            while not self.kv.can_allocate(req, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self.kv.allocate(req, num_new)
                self._emit(out, req, num_new, num_drafts)
                budget -= num_new
                i += 1
        if not out.preempted:
            budget = self._admit_waiting(out, budget, only)
        return out

    def _tokens_to_compute(self, req: Request, budget: int) -> tuple[int, int]:
        pending = req.num_tokens - req.num_computed_tokens
        drafts = len(req.spec_token_ids)
        if pending + drafts > budget:  # drafts go first, then the prompt is chunked
            drafts = max(0, budget - pending)
            del req.spec_token_ids[drafts:]
        return min(pending + drafts, budget), drafts

    def _admit_waiting(self, out: SchedulerOutput, budget: int, only: list[Request] | None = None) -> int:
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            if only is None:
                req = self.waiting.peek()
            else:
                req = next((r for r in only if r in self.waiting), None)
            if req is None:
                break
            hits = self.kv.find_cached_prefix(req)
            hit_tokens = len(hits) * self.kv.block_size
            num_new = min(req.num_tokens - hit_tokens, budget)
            # keep one free block per running request for its next decode block, so a fresh
            # admission does not immediately force a preemption (thrashing on a small pool)
            headroom = len(self.running)
            if not self.kv.can_allocate(req, hit_tokens + num_new, hits, headroom):
                break
            self.waiting.remove(req)
            self.kv.allocate(req, hit_tokens + num_new, hits)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._emit(out, req, num_new, 0)
            budget -= num_new
        return budget

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        out.preempted.append(req)
        self.num_preemptions += 1

    def requeue(self, req: Request) -> None:
        """Back to the head of the queue with nothing computed (KV freed, drafts dropped), to
        be recomputed from its committed tokens: what a step that failed with it leaves."""
        req.spec_token_ids = []
        if req in self.waiting:
            return
        if req in self.running:
            self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    @staticmethod
    def _emit(out: SchedulerOutput, req: Request, num_new: int, num_drafts: int) -> None:
        out.requests.append(req)
        out.num_tokens.append(num_new)
        out.num_drafts.append(num_drafts)
