"""Continuous batching at iteration level, FCFS, with a token budget per step.

One rule covers prefill, chunked prefill, prefix hits, decode and draft verification: each
running request's computed length catches up with its known length (committed tokens plus
drafts), as far as the step's token budget allows. Slots for every scheduled token, drafts
included, are reserved before the step runs, so the forward pass never allocates. When the
pool runs dry the newest running request is preempted (its blocks freed, recomputed later
from its committed tokens), so a full pool slows requests down but never fails or loses
output.

The scheduler does not sample, detokenise or check stop conditions: see Engine.
"""

from __future__ import annotations

from collections import deque
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


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take a finished or aborted request out and return its blocks to the pool."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
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
            budget = self._admit_waiting(out, budget)
        return out

    def _tokens_to_compute(self, req: Request, budget: int) -> tuple[int, int]:
        pending = req.num_tokens - req.num_computed_tokens
        drafts = len(req.spec_token_ids)
        if pending + drafts > budget:  # drafts go first, then the prompt is chunked
            drafts = max(0, budget - pending)
            del req.spec_token_ids[drafts:]
        return min(pending + drafts, budget), drafts

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hits = self.kv.find_cached_prefix(req)
            hit_tokens = len(hits) * self.kv.block_size
            num_new = min(req.num_tokens - hit_tokens, budget)
            # keep one free block per running request for its next decode block, so a fresh
            # admission does not immediately force a preemption (thrashing on a small pool)
            headroom = len(self.running)
            if not self.kv.can_allocate(req, hit_tokens + num_new, hits, headroom):
                break
            self.waiting.popleft()
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

    @staticmethod
    def _emit(out: SchedulerOutput, req: Request, num_new: int, num_drafts: int) -> None:
        out.requests.append(req)
        out.num_tokens.append(num_new)
        out.num_drafts.append(num_drafts)
