"""Draft-model proposer: a smaller model with the target's vocabulary drafts k tokens.

KV layout: the draft model has its own paged KV tensors with exactly as many blocks as the
target's, and a request's one block table (`req.block_ids`, owned by the KVCacheManager)
addresses both. So the draft cache needs no allocator of its own: allocation, prefix-cache
sharing, rollback (truncate) and freeing of the target's blocks carry over. The memory
budget (`kv_cache_memory_gb`) is shared: when the block count is derived from it, the
target's cache is re-sized so that target + draft blocks fit in it together.

Validity of the draft's KV is tracked per request as a cache over committed tokens: after
drafting it holds positions [0, N) (committed) plus the fed drafts d1..d(k-1) at
[N, N+k-1). At the next step the valid prefix is N plus the drafts the target accepted,
clipped to the request's computed length (rollback may drop a block). A preemption (the
request's blocks were freed) or a new request starts from zero; the first draft forward of
the step then catches the draft up on every token it has not seen (the prompt on the first
step, the bonus token afterwards), batched with the other requests.

Per step: k draft forwards, each one batched over all speculating requests. Greedy requests
take the argmax of the draft's (penalised) logits; sampled requests draw from the draft's
distribution processed with their own temperature/top-k/top-p/min-p/penalties, with noise
from a salted copy of the request's seed (independent of the verifier's noise), and the
distribution is returned as DraftTree.probs so verification stays exact.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field, replace

import torch

from specserve.config import CacheConfig
from specserve.model.arch import ModelArch
from specserve.model.attention import AttentionMetadata
from specserve.model.loader import resolve_model_dir
from specserve.model.runner import ModelRunner
from specserve.request import Request
from specserve.sampler import SamplingBatch, apply_penalties, exponential_noise, processed_probs
from specserve.spec_decode.draft_tree import DraftTree

_DRAFT_SEED_SALT = 0x5DEECE66D  # the draft's noise stream must differ from the verifier's
_MAX_BATCHED_CATCH_UP = 16  # longer catch-ups would blow up the batch's dense attention mask


@dataclass
class _DraftState:
    base: int = 0  # committed length when the last draft was made
    fed: list[int] = field(default_factory=list)  # drafts fed to the draft model at base..
    preemptions: int = 0  # scheduler's preemption count when this state was written


class DraftModelProposer:
    name = "draft_model"

    def __init__(self, model: str, engine) -> None:
        target = engine.runner
        self.model_dir = resolve_model_dir(model)
        self.arch = ModelArch.from_dir(self.model_dir)
        if self.arch.vocab_size != engine.arch.vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary has {self.arch.vocab_size} "
                f"tokens but the target's has {engine.arch.vocab_size}; they must be the same")
        cache = engine.config.cache
        if cache.num_blocks is None:  # share the memory budget with the target
            t, d = _bytes_per_block(target), _bytes_per_block_of(self.arch, target)
            num_blocks = max(16, int(cache.kv_cache_memory_gb * (1 << 30)) // (t + d))
            _resize_cache(target, num_blocks)
        self.runner = ModelRunner(
            self.model_dir, self.arch, replace(engine.config.model, model=model),
            CacheConfig(target.block_size, target.num_blocks), engine.max_model_len)
        self.engine = engine
        self.chunk_size = engine.config.scheduler.max_num_batched_tokens
        self.vocab_size = self.arch.vocab_size
        self._state: weakref.WeakKeyDictionary[Request, _DraftState] = weakref.WeakKeyDictionary()
        self.last_forward_time = 0.0  # seconds of draft forwards in the last propose

    # -- proposing --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[Request], max_drafts: list[int]) -> list[DraftTree | None]:
        start = time.perf_counter()
        kv = self.engine.kv
        preemptions = self.engine.scheduler.num_preemptions
        reqs, ks = [], []
        for req, k in zip(requests, max_drafts):
            # reserve the slots of the next verify step now: the draft writes k - 1 of them
            if k > 0 and kv.can_allocate(req, 1 + k):
                kv.allocate(req, 1 + k)
                reqs.append(req)
                ks.append(k)
        trees: dict[int, DraftTree] = {}
        if reqs:
            drafts = self._run(reqs, ks, preemptions)
            for req, (tokens, probs) in zip(reqs, drafts):
                trees[id(req)] = DraftTree.chain(tokens, probs)
        self.last_forward_time = time.perf_counter() - start
        return [trees.get(id(r)) for r in requests]

    def _valid_prefix(self, req: Request, preemptions: int) -> int:
        """Positions whose draft KV holds this request's committed tokens."""
        st = self._state.get(req)
        if st is None or st.preemptions != preemptions:
            return 0
        n = st.base
        committed = req.all_token_ids
        for tok in st.fed:
            if n >= len(committed) or committed[n] != tok:
                break
            n += 1
        return min(n, req.num_computed_tokens, req.num_tokens - 1)

    def _run(self, reqs: list[Request], ks: list[int], preemptions: int):
        tokens = [[] for _ in reqs]  # drafts so far
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        # step 0: catch up on committed tokens the draft has not seen
        starts = [self._valid_prefix(r, preemptions) for r in reqs]
        feed = [r.all_token_ids[s:] for r, s in zip(reqs, starts)]
        for i, req in enumerate(reqs):  # long catch-ups (prompts) run alone, in chunks
            while len(feed[i]) > _MAX_BATCHED_CATCH_UP:
                chunk = feed[i][:min(len(feed[i]) - 1, self.chunk_size)]
                self._forward([req], [starts[i]], [chunk])
                starts[i] += len(chunk)
                feed[i] = feed[i][len(chunk):]
        active = list(range(len(reqs)))
        for step in range(max(ks)):
            logits = self._forward([reqs[i] for i in active], [starts[i] for i in active],
                                   [feed[i] for i in active])
            toks, q = self._sample(logits, [reqs[i] for i in active], [tokens[i] for i in active])
            for row, i in enumerate(active):
                tokens[i].append(toks[row])
                if q is not None and not reqs[i].params.greedy:
                    probs[i].append(q[row])
                starts[i] += len(feed[i])
                feed[i] = [toks[row]]
            active = [i for i in active if len(tokens[i]) < ks[i]]
            if not active:
                break
        out = []
        for i, req in enumerate(reqs):
            self._state[req] = _DraftState(req.num_tokens, tokens[i][:-1], preemptions)
            p = torch.stack(probs[i]) if probs[i] else None
            out.append((tokens[i], p))
        return out

    def _forward(self, reqs: list[Request], starts: list[int], feeds: list[list[int]]) -> torch.Tensor:
        """One draft forward over new tokens at [start, start + len(feed)); last-row logits [B, V]."""
        runner = self.runner
        ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        for s, f in zip(starts, feeds):
            ids += f
            positions += range(s, s + len(f))
            last.append(len(ids) - 1)
        meta = AttentionMetadata.build([s + len(f) for s, f in zip(starts, feeds)],
                                       [len(f) for f in feeds], [r.block_ids for r in reqs],
                                       runner.block_size, runner.device, runner.backend.layout)
        dev = runner.device
        hidden = runner.model(torch.tensor(ids, dtype=torch.int64, device=dev),
                              torch.tensor(positions, dtype=torch.int64, device=dev),
                              runner.kv_caches, meta, runner.backend)
        hidden = hidden.index_select(0, torch.tensor(last, dtype=torch.int64, device=dev))
        return runner.model.compute_logits(hidden)

    def _sample(self, logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]]):
        """Draft token per row, and the processed draft distribution q [B, V] (None: all greedy)."""
        batch = SamplingBatch.build(list(zip(reqs, [list(d) for d in drafts])), self.vocab_size,
                                    logits.device)
        greedy_ids = apply_penalties(logits, batch).argmax(-1)
        if batch.all_greedy:
            return greedy_ids.tolist(), None
        q = processed_probs(logits, batch)
        noise = exponential_noise(batch.seeds ^ _DRAFT_SEED_SALT, batch.positions, self.vocab_size)
        sampled = (q / noise.to(q.dtype)).argmax(-1)
        return torch.where(batch.greedy, greedy_ids, sampled).tolist(), q


def _bytes_per_block_of(arch: ModelArch, like: ModelRunner) -> int:
    return (2 * arch.num_layers * like.block_size * arch.num_kv_heads * arch.head_dim
            * like.dtype.itemsize)


def _bytes_per_block(runner: ModelRunner) -> int:
    return _bytes_per_block_of(runner.arch, runner)


def _resize_cache(runner: ModelRunner, num_blocks: int) -> None:
    """Re-allocate the target's KV tensors with num_blocks (before any request ran)."""
    a = runner.arch
    shape = (num_blocks, runner.block_size, a.num_kv_heads, a.head_dim)
    runner.kv_caches = []  # free the old tensors first
    runner.kv_caches = [(torch.zeros(shape, dtype=runner.dtype, device=runner.device),
                         torch.zeros(shape, dtype=runner.dtype, device=runner.device))
                        for _ in range(a.num_layers)]
    runner.num_blocks = num_blocks
