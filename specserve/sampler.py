"""Batched sampling with per-row parameters and batch-independent randomness.

Every row of logits belongs to one request and one output position. Rows carry their own
temperature, top-k, top-p, min-p and penalties; all of them are applied with tensor ops over
the whole batch, never a Python loop over vocabulary-sized tensors.

Randomness is a counter-based hash of (request seed, output position, token id), turned into
Exponential(1) noise: sampling from a distribution p is argmax(p / noise) (the "exponential
race", equivalent to categorical sampling and free of host syncs). A seeded request therefore
draws the same stream whatever else is in the batch, and speculation reads the same noise a
plain decode step would, so seeded outputs do not depend on the batch or on drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.request import Request, TokenLogprob

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """Uniform(0, 1) float64 [N, width], a pure function of (seed, position, column)."""
    seeds = seeds.to(torch.int64)
    row = _mix32((seeds & _M32) ^ _mix32(((seeds >> 32) & _M32) ^ _mix32(positions.to(torch.int64) & _M32)))
    cols = torch.arange(width, dtype=torch.int64, device=seeds.device)
    x = _mix32((row[:, None] + cols[None, :] * 0x9E3779B9) & _M32)
    x = _mix32(x ^ (row[:, None] >> 7))
    return (x.double() + 0.5) / 4294967296.0


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    return -torch.log(uniform_noise(seeds, positions, width))


@dataclass
class SamplingBatch:
    """Per-row sampling parameters; a row is one (request, output position) pair."""

    temperature: torch.Tensor  # [N] float (1.0 for greedy rows, whose result is the argmax)
    greedy: torch.Tensor  # [N] bool
    top_k: torch.Tensor | None  # [N] int64, vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [N] float
    min_p: torch.Tensor | None  # [N] float
    seeds: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64: index of the sampled token in the request's sequence
    presence: torch.Tensor | None  # [N] float; None if no row has penalties
    frequency: torch.Tensor | None
    repetition: torch.Tensor | None
    output_counts: torch.Tensor | None  # [N, V] float: occurrences in the output so far
    seen_mask: torch.Tensor | None  # [N, V] bool: token occurs in prompt or output
    all_greedy: bool

    @staticmethod
    def build(rows: list[tuple[Request, list[int]]], vocab_size: int, device) -> "SamplingBatch":
        """rows: (request, draft tokens preceding this row) for each row of logits."""
        params = [r.params for r, _ in rows]
        f = lambda vals, dt=torch.float32: torch.tensor(vals, dtype=dt, device=device)  # noqa: E731
        greedy = [p.greedy for p in params]
        batch = SamplingBatch(
            temperature=f([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
            greedy=f(greedy, torch.bool),
            top_k=f([p.top_k or vocab_size for p in params], torch.int64)
            if any(p.top_k for p in params) else None,
            top_p=f([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
            min_p=f([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
            seeds=f([r.sampling_seed for r, _ in rows], torch.int64),
            positions=f([r.num_tokens + len(d) for r, d in rows], torch.int64),
            presence=None, frequency=None, repetition=None, output_counts=None, seen_mask=None,
            all_greedy=all(greedy),
        )
        if any(p.has_penalties for p in params):
            batch.presence = f([p.presence_penalty for p in params])
            batch.frequency = f([p.frequency_penalty for p in params])
            batch.repetition = f([p.repetition_penalty for p in params])
            outputs = [r.output_token_ids + d for r, d in rows]
            batch.output_counts = _counts(outputs, vocab_size, device)
            prompts = _counts([r.prompt_token_ids for r, _ in rows], vocab_size, device)
            batch.seen_mask = (batch.output_counts + prompts) > 0
        return batch


def _counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    width = max(1, max(len(t) for t in token_lists))
    ids = torch.full((len(token_lists), width), vocab_size, dtype=torch.int64)
    for i, t in enumerate(token_lists):
        ids[i, :len(t)] = torch.tensor(t, dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, ids.to(device), torch.ones_like(ids, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """vLLM/OpenAI semantics: repetition over prompt+output, presence/frequency over output."""
    if b.presence is None:
        return logits
    rep = b.repetition[:, None].expand_as(logits)
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(b.seen_mask, scaled, logits)
    logits = logits - b.frequency[:, None] * b.output_counts
    return logits - b.presence[:, None] * (b.output_counts > 0).float()


def processed_probs(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """The target distribution a sampled row draws from: penalties, temperature, top-k/p, min-p."""
    logits = apply_penalties(logits, b) / b.temperature[:, None]
    if b.top_k is not None or b.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if b.top_k is not None:
            ranks = torch.arange(logits.shape[-1], device=logits.device)
            drop |= ranks[None, :] >= b.top_k[:, None]
        if b.top_p is not None:
            sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
            before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
            drop |= before >= b.top_p[:, None]
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    if b.min_p is not None:
        threshold = b.min_p[:, None] * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """logits [N, V] float32 -> token ids [N] int64."""
    greedy_ids = apply_penalties(logits, b).argmax(-1)
    if b.all_greedy:
        return greedy_ids
    probs = processed_probs(logits, b)
    noise = exponential_noise(b.seeds, b.positions, logits.shape[-1]).to(probs.dtype)
    sampled = (probs / noise).argmax(-1)
    return torch.where(b.greedy, greedy_ids, sampled)


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, n: list[int]) -> list[TokenLogprob]:
    """Raw (unprocessed) logprobs of the chosen tokens and each row's top-n."""
    logprobs = logits.log_softmax(-1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    top_n = max(n) if n else 0
    top_vals, top_ids = (logprobs.topk(top_n, dim=-1) if top_n else (None, None))
    out = []
    for i, tok in enumerate(token_ids.tolist()):
        top = list(zip(top_ids[i, :n[i]].tolist(), top_vals[i, :n[i]].tolist())) if n[i] else []
        out.append(TokenLogprob(tok, chosen[i], top))
    return out
