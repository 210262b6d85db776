"""Draft-model proposer: a smaller model with the target's vocabulary drafts a chain.

KV: the draft has its own paged KV tensors with as many blocks as the target's, addressed by
the request's one block table, so allocation, prefix sharing, rollback and freeing carry over
(docs/speculation.md); the decoder reserves the next verify step's slots before drafting. Per
request a cache records what the draft's KV holds: the committed positions [0, N) plus the
fed drafts; next step the valid prefix is N plus the drafts the target accepted, clipped to
the target's computed length. Per step: k draft forwards, each batched over the drafting
requests (the first also catches up on every token not seen yet). Greedy requests take the
argmax; sampled ones draw from the draft's distribution under their own sampling parameters
(penalties are verification's business) with noise from their seed (salted unless the request
is seeded: coupled drafting), and that q travels with the chain (DraftTree.probs). Scores are
the chain's cumulative log q.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specserve.config import CacheConfig, ModelConfig
from specserve.host import int_tensor
from specserve.model.arch import ModelArch
from specserve.model.loader import resolve_model_dir
from specserve.model.runner import ModelRunner
from specserve.sampling import SamplingBatch, exponential_noise, processed_probs, row_argmax, top_logprobs
from specserve.spec_decode.draft_tree import DraftTree, ProposeBatch

_DRAFT_SEED_SALT = 0x5DEECE66D  # the draft's noise stream must differ from the verifier's
_MAX_BATCHED_CATCH_UP = 16  # longer catch-ups (a prompt) run alone, in chunks


def draft_arch(model: str, target: ModelArch) -> tuple[object, ModelArch]:
    """The draft's directory and config; its vocabulary must be the target's."""
    model_dir = resolve_model_dir(model)
    arch = ModelArch.from_dir(model_dir)
    if arch.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has {arch.vocab_size} "
                         f"tokens but the target's has {target.vocab_size}; they must be the same")
    return model_dir, arch


class DraftModelProposer:
    name = "draft_model"
    needs_hidden = False
    costs_per_request = True

    def __init__(self, model: str, target: ModelRunner, model_config: ModelConfig, max_model_len: int,
                 chunk_size: int) -> None:
        model_dir, arch = draft_arch(model, target.arch)
        # a draft's bits never decide the output: its products keep the fastest kernels
        self.runner = ModelRunner(model_dir, arch, replace(model_config, model=model, batch_invariant=False),
                                  CacheConfig(target.block_size, target.num_blocks), max_model_len)
        self.chunk_size = chunk_size
        self.vocab_size = arch.vocab_size
        self._state: dict[str, tuple[int, list[int]]] = {}  # request -> (committed length when
        # it last drafted, the drafts then fed to the draft model from there)

    def observe(self, request_ids, starts, sizes, hidden) -> None:  # the draft runs on tokens alone
        pass

    def free(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> list[DraftTree | None]:
        n = len(batch.request_ids)
        tokens: list[list[int]] = [[] for _ in range(n)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        scores: list[list[float]] = [[] for _ in range(n)]
        starts = [self._valid_prefix(j, batch) for j in range(n)]
        feed = [batch.token_ids[j][s:] for j, s in enumerate(starts)]
        for j in range(n):  # long catch-ups (prompts) run alone, in chunks
            while len(feed[j]) > _MAX_BATCHED_CATCH_UP:
                chunk = feed[j][:min(len(feed[j]) - 1, self.chunk_size)]
                self._forward([batch.block_ids[j]], [starts[j]], [chunk])
                starts[j] += len(chunk)
                feed[j] = feed[j][len(chunk):]
        active = [j for j in range(n) if batch.max_drafts[j] > 0]
        while active:
            logits = self._forward([batch.block_ids[j] for j in active], [starts[j] for j in active],
                                   [feed[j] for j in active])
            toks, logq, q = self._sample(logits, batch, active, [len(tokens[j]) for j in active])
            for row, j in enumerate(active):
                tokens[j].append(toks[row])
                scores[j].append((scores[j][-1] if scores[j] else 0.0) + logq[row])
                if q is not None and not batch.params[j].greedy:
                    probs[j].append(q[row])
                starts[j] += len(feed[j])
                feed[j] = [toks[row]]
            active = [j for j in active if len(tokens[j]) < batch.max_drafts[j] and scores[j][-1] >= batch.min_score]
        out: list[DraftTree | None] = []
        for j, rid in enumerate(batch.request_ids):
            self._state[rid] = (len(batch.token_ids[j]), tokens[j][:-1])
            keep = sum(1 for s in scores[j] if s >= batch.min_score)
            p = torch.stack(probs[j][:keep]) if probs[j] and keep else None
            out.append(DraftTree.chain(tokens[j][:keep], p, scores[j][:keep]) if keep else None)
        return out

    def _valid_prefix(self, j: int, batch: ProposeBatch) -> int:
        """Positions whose draft KV holds request j's committed tokens."""
        n, fed = self._state.get(batch.request_ids[j], (0, []))
        committed = batch.token_ids[j]
        for tok in fed:
            if n >= len(committed) or committed[n] != tok:
                break
            n += 1
        return min(n, batch.num_computed[j], len(committed) - 1)

    def _forward(self, block_ids: list[list[int]], starts: list[int], feeds: list[list[int]]) -> torch.Tensor:
        """One draft forward over new tokens at [start, start + len(feed)); last-row logits [B, V]."""
        runner = self.runner
        ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        for s, f in zip(starts, feeds):
            ids += f
            positions += range(s, s + len(f))
            last.append(len(ids) - 1)
        meta = runner.backend.build_metadata([s + len(f) for s, f in zip(starts, feeds)],
                                             [len(f) for f in feeds], block_ids,
                                             runner.block_size, runner.device)
        ids_pos = int_tensor([ids, positions], runner.device)
        hidden = runner.model(ids_pos[0], ids_pos[1], runner.kv_caches, meta, runner.backend)
        if len(last) < len(ids):  # a catch-up: each request's last row
            hidden = hidden.index_select(0, int_tensor(last, runner.device))
        return runner.model.compute_logits(hidden)

    def _sample(self, logits: torch.Tensor, batch: ProposeBatch, rows: list[int], done: list[int]):
        """Draft token per row, its log q, and the draft distribution q [B, V] (None: all greedy)."""
        if all(batch.params[j].greedy for j in rows):  # the argmax and its log q, one call on a CPU
            logq, ids = top_logprobs(logits, 1)
            return ids[:, 0].tolist(), logq[:, 0].tolist(), None
        greedy_ids = row_argmax(logits)
        params = [replace(p, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
                  if (p := batch.params[j]).has_penalties else p for j in rows]  # penalties: verification's
        positions = [len(batch.token_ids[j]) + d for j, d in zip(rows, done)]
        # a seeded request is verified against the target's own draws (coupled): drafting with
        # the same noise makes the draft's choice the target's wherever q and p agree; otherwise
        # the draft's noise must be independent of the verifier's
        seeds = [batch.seeds[j] if batch.params[j].seed is not None else batch.seeds[j] ^ _DRAFT_SEED_SALT
                 for j in rows]
        b = SamplingBatch.build(params, seeds, positions, self.vocab_size, logits.device)
        q = processed_probs(logits, b)
        noise = exponential_noise(b.seeds, b.positions, self.vocab_size)
        ids = torch.where(b.greedy, greedy_ids, row_argmax(q / noise.to(q.dtype)))
        logq = torch.log(q.gather(1, ids[:, None])[:, 0].clamp_min(1e-30))
        return ids.tolist(), logq.tolist(), q
