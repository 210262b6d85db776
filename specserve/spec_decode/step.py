"""The speculative half of Engine.step(): sample or verify the step's logits, then propose.

`SpecDecoder` runs for every engine, speculating or not:
  * rows of requests without drafts are sampled by specserve.sampler;
  * rows of requests with k drafts (k + 1 rows: the target after 0..k drafts) go through the
    rejection sampler: greedy rows accept the longest prefix equal to the target argmax,
    sampled rows use the Leviathan/Chen rule against the target distribution processed with
    the request's own temperature, top-k, top-p, min-p and penalties (penalties see the
    drafts before each row, exactly as plain decoding would have seen those tokens);
  * after the update, the proposer drafts the next tokens of each running request.
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from specserve.config import SpecConfig
from specserve.model.runner import StepLogits
from specserve.request import Request, TokenLogprob
from specserve.sampler import (SamplingBatch, apply_penalties, exponential_noise,
                               gather_logprobs, processed_probs, sample, uniform_noise)
from specserve.scheduler.scheduler import SchedulerOutput

StepResult = tuple[list[int], list[TokenLogprob] | None] | None
logger = logging.getLogger("specserve.spec_decode")


class SpecDecoder:
    """No speculation: every caught-up request gets one sampled token per step."""

    max_drafts = 0
    log_interval = 5.0  # seconds between acceptance log lines of speculating decoders

    def __init__(self, config: SpecConfig, engine) -> None:
        self.config = config
        self.engine = engine
        self.vocab_size = engine.arch.vocab_size
        self._last_log = time.monotonic()
        self._last_stats = None

    @staticmethod
    def create(config: SpecConfig, engine) -> "SpecDecoder":
        if config.method is None:
            return SpecDecoder(config, engine)
        from specserve.spec_decode.proposers import make_spec_decoder

        return make_spec_decoder(config, engine)

    def tree_parents(self, sched: SchedulerOutput) -> list[list[int] | None] | None:
        return None

    def propose(self, running: list[Request]) -> None:
        return None

    def _maybe_log(self) -> None:
        """Speculating decoders call this after proposing: mean acceptance length and
        per-position rates since the last line, every `log_interval` seconds."""
        now = time.monotonic()
        if now - self._last_log < self.log_interval:
            return
        stats = self.engine._stats
        prev = self._last_stats
        if stats.spec_num_drafts == (prev.spec_num_drafts if prev else 0):
            return
        from specserve.metrics import format_spec_log

        logger.info(format_spec_log(stats, prev))
        self._last_log, self._last_stats = now, copy.deepcopy(stats)

    # -- sampling and verification ---------------------------------------------------------------
    def sample_and_verify(self, sched: SchedulerOutput, step: StepLogits) -> list[StepResult]:
        rows: list[tuple[Request, list[int]]] = []
        for req, nr in zip(sched.requests, step.num_rows):
            rows += [(req, req.spec_token_ids[:j]) for j in range(nr)]
        if not rows:
            return [None] * len(sched.requests)
        batch = SamplingBatch.build(rows, self.vocab_size, step.logits.device)
        if not any(sched.num_drafts):
            emitted = sample(step.logits, batch).tolist()
            per_req = [[emitted[s]] if s >= 0 else None for s in step.row_start]
        else:
            per_req = self._verify(sched, step, batch)
        return [self._with_logprobs(req, toks, step, s)
                for req, toks, s in zip(sched.requests, per_req, step.row_start)]

    def _verify(self, sched: SchedulerOutput, step: StepLogits, batch: SamplingBatch):
        """Rejection sampling over every request with rows (no drafts is k = 0)."""
        from specserve.kernels import rejection_sample

        idx = [i for i, s in enumerate(step.row_start) if s >= 0]
        reqs = [sched.requests[i] for i in idx]
        ks = [step.num_rows[i] - 1 for i in idx]
        starts = [step.row_start[i] for i in idx]
        num, kmax, vocab = len(idx), max(ks), self.vocab_size
        device = step.logits.device
        # row r of request b sits at starts[b] + r; pad rows past k with the request's last row
        gather = torch.tensor([[s + min(r, k) for r in range(kmax + 1)] for s, k in zip(starts, ks)],
                              dtype=torch.int64, device=device)
        if batch.all_greedy:
            target = apply_penalties(step.logits, batch)
        else:
            target = torch.where(batch.greedy[:, None], apply_penalties(step.logits, batch),
                                 processed_probs(step.logits, batch))
        target = target[gather]  # [B, K+1, V]
        drafts = torch.zeros(num, max(kmax, 1), dtype=torch.int64)
        for b, req in enumerate(reqs):
            drafts[b, :ks[b]] = torch.tensor(req.spec_token_ids[:ks[b]], dtype=torch.int64)
        draft_probs = self._draft_probs(reqs, ks, max(kmax, 1), device)
        greedy = torch.tensor([r.params.greedy for r in reqs], dtype=torch.bool, device=device)
        if batch.all_greedy:
            uniforms = torch.full((num, max(kmax, 1)), 0.5, device=device)
            noise = torch.ones(num, kmax + 1, vocab, device=device)
        else:
            seeds, pos = batch.seeds[gather], batch.positions[gather]  # [B, K+1]
            u = uniform_noise(seeds.flatten(), pos.flatten(), vocab + 1).view(num, kmax + 1, vocab + 1)
            noise = (-torch.log(u[..., :vocab])).float()
            uniforms = u[:, :max(kmax, 1), vocab].float()
        out, n_emit = rejection_sample(drafts.to(device), torch.tensor(ks, device=device),
                                       draft_probs, target.float(), greedy, uniforms, noise)
        out, n_emit = out.tolist(), n_emit.tolist()
        per_req: list[list[int] | None] = [None] * len(sched.requests)
        for b, i in enumerate(idx):
            per_req[i] = out[b][:n_emit[b]]
            self._count(reqs[b], ks[b], n_emit[b] - 1)
        return per_req

    def _draft_probs(self, reqs, ks, kmax, device) -> torch.Tensor | None:
        if all(r.spec_draft_probs is None for r in reqs):
            return None  # every draft is one-hot (n-gram, greedy draft model)
        probs = torch.zeros(len(reqs), kmax, self.vocab_size, device=device)
        for b, req in enumerate(reqs):
            if ks[b] == 0:
                continue
            if req.spec_draft_probs is not None:
                probs[b, :ks[b]] = req.spec_draft_probs[:ks[b]].to(device)
            else:
                ids = torch.tensor(req.spec_token_ids[:ks[b]], device=device)
                probs[b, torch.arange(ks[b]), ids] = 1.0
        return probs

    def _count(self, req: Request, k: int, accepted: int) -> None:
        if k == 0:
            return
        stats = self.engine._stats
        req.num_draft_tokens += k
        req.num_accepted_tokens += accepted
        stats.spec_num_drafts += 1
        stats.spec_num_draft_tokens += k
        stats.spec_num_accepted_tokens += accepted
        for j in range(accepted):
            stats.spec_accepted_per_pos[j] += 1

    def _with_logprobs(self, req: Request, tokens: list[int] | None, step: StepLogits,
                       start: int) -> StepResult:
        if tokens is None:
            return None
        if req.params.logprobs is None:
            return tokens, None
        rows = step.logits[start:start + len(tokens)]
        ids = torch.tensor(tokens, dtype=torch.int64, device=rows.device)
        return tokens, gather_logprobs(rows, ids, [req.params.logprobs] * len(tokens))


__all__ = ["SpecDecoder", "exponential_noise"]
