"""Batched sampling with per-row parameters and batch-independent randomness.

Every row of logits belongs to one request and one output position. Rows carry their own
temperature, top-k, top-p, min-p and penalties; all of them are applied with tensor ops over
the whole batch, never a Python loop over vocabulary-sized tensors.

Randomness is a counter-based hash of (request seed, output position, column), turned into
Exponential(1) noise: sampling from a distribution p is argmax(p / noise) (the "exponential
race", equivalent to categorical sampling and free of host syncs). A seeded request therefore
draws the same stream whatever else is in the batch, and speculation reads the same noise a
plain decode step would.

Penalty counts are kept per request as tokens are committed (`TokenCounts`), so a step only
adds the few tokens that are new; rows of draft nodes add their ancestors on top.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.cpu import layer_ops
from specserve.request import SamplingParams, TokenLogprob

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def _mix32_wrapping(x: torch.Tensor) -> torch.Tensor:
    """The same finaliser on int32 tensors (products wrap; shifts made logical by masks):
    half the memory traffic of the int64 form, for the per-column work."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * -2048144789  # 0x85EBCA6B as int32
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * -1028477387  # 0xC2B2AE35 as int32
    return x ^ ((x >> 16) & 0xFFFF)


def uniform_at(seeds: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Uniform(0, 1) float32 (24 random bits, never 0 or 1), a pure function of (seed,
    position, column), elementwise over the broadcast shape of the three int64 tensors."""
    seeds = seeds.to(torch.int64)
    row = _mix32((seeds & _M32) ^ _mix32(((seeds >> 32) & _M32) ^ _mix32(positions.to(torch.int64) & _M32)))
    row = torch.where(row >= 1 << 31, row - (1 << 32), row).to(torch.int32)
    cols = (columns.to(torch.int64) * 0x9E3779B9) & _M32
    cols = torch.where(cols >= 1 << 31, cols - (1 << 32), cols).to(torch.int32)
    x = _mix32_wrapping(row ^ cols)
    return (((x >> 8) & 0xFFFFFF).float() + 0.5) * (1.0 / (1 << 24))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """seeds, positions [N] -> Uniform(0, 1) float32 [N, width] (columns 0 .. width - 1)."""
    cols = torch.arange(width, dtype=torch.int64, device=seeds.device)
    return uniform_at(seeds[:, None], positions[:, None], cols[None, :])


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    return -torch.log(uniform_noise(seeds, positions, width))


class TokenCounts:
    """One request's token occurrences for penalties: `seen` (prompt or output, [V] bool) and
    `output` ([V] float), brought up to date with `sync` before each step."""

    def __init__(self, prompt_token_ids: list[int], vocab_size: int, device) -> None:
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.seen[torch.tensor(prompt_token_ids, dtype=torch.int64, device=device)] = True
        self.output = torch.zeros(vocab_size, device=device)
        self.num_prompt = len(prompt_token_ids)
        self.counted = 0  # output tokens already in `output`

    def sync(self, all_token_ids: list[int]) -> "TokenCounts":
        new = all_token_ids[self.num_prompt + self.counted:]
        if new:
            ids = torch.tensor(new, dtype=torch.int64, device=self.output.device)
            self.output.index_add_(0, ids, torch.ones(len(new), device=ids.device))
            self.seen[ids] = True
            self.counted += len(new)
        return self


def row_counts(counts: list[TokenCounts], extra: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: its request's counts plus `extra` tokens (the draft nodes before the row) ->
    (output counts [R, V] float, seen [R, V] bool)."""
    output = torch.stack([c.output for c in counts])
    seen = torch.stack([c.seen for c in counts])
    rows = [r for r, toks in enumerate(extra) for _ in toks]
    if rows:
        device = output.device
        r = torch.tensor(rows, dtype=torch.int64, device=device)
        t = torch.tensor([t for toks in extra for t in toks], dtype=torch.int64, device=device)
        output.index_put_((r, t), torch.ones(len(rows), device=device), accumulate=True)
        seen[r, t] = True
    return output, seen


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
    def build(params: list[SamplingParams], seeds: list[int], positions: list[int], vocab_size: int,
              device, counts: tuple[torch.Tensor, torch.Tensor] | None = None) -> "SamplingBatch":
        """One entry per row; `counts` (row_counts) is needed when any row has penalties, and
        ignored otherwise."""
        f = lambda vals, dt=torch.float32: torch.tensor(vals, dtype=dt, device=device)  # noqa: E731
        greedy = [p.greedy for p in params]
        batch = SamplingBatch(
            temperature=f([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
            greedy=f(greedy, torch.bool),
            top_k=f([p.top_k or vocab_size for p in params], torch.int64)
            if any(p.top_k for p in params) else None,
            top_p=f([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
            min_p=f([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
            seeds=f(seeds, torch.int64), positions=f(positions, torch.int64),
            presence=None, frequency=None, repetition=None, output_counts=None, seen_mask=None,
            all_greedy=all(greedy),
        )
        if any(p.has_penalties for p in params):
            assert counts is not None, "rows with penalties need their token counts"
            batch.presence = f([p.presence_penalty for p in params])
            batch.frequency = f([p.frequency_penalty for p in params])
            batch.repetition = f([p.repetition_penalty for p in params])
            batch.output_counts, batch.seen_mask = counts
        return batch


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


def c_rows(x: torch.Tensor) -> bool:
    """Whether our C kernels (specserve.kernels.cpu.layer_ops) can read x's rows: [N, V] float32 on
    an x86 CPU, unit stride along a row."""
    return layer_ops.rows_view(x) is not None


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] -> [N] int64, exactly x.argmax(-1); float32 on an x86 CPU through our C kernel
    (specserve.kernels.cpu.layer_ops.argmax: PyTorch's takes ~50 us per 49k-wide row there). Plain
    sampling, verification and drafting all take their argmax here."""
    if x.numel() >= 1024 and c_rows(x):
        return layer_ops.argmax(x)
    return x.argmax(-1)


def top_logprobs(logits: torch.Tensor, k: int, d2t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> the k most likely columns of each row, as (log probabilities [N, k]
    float32, descending; columns [N, k] int64, through d2t [V] when given: a draft
    vocabulary's ids in the target's): what drafting (EAGLE, Medusa, the draft model) expands.
    On an x86 CPU one C call (specserve.kernels.cpu.layer_ops.top_logprobs, ~3x PyTorch's
    log_softmax then topk over a vocabulary); ties may come in another order than PyTorch's."""
    logits = logits.float()
    if c_rows(logits):
        return layer_ops.top_logprobs(logits, k, d2t)
    val, idx = logits.log_softmax(-1).topk(k, -1)
    return val, (d2t[idx] if d2t is not None else idx)


def draft_top_k(logits: torch.Tensor, k: int, d2t: torch.Tensor | None = None):
    """What the host calls that grow draft trees (specserve.spec_decode.tree_ops: EAGLE's
    children, Medusa's trees) read of a draft's logits [N, V]: (rows_view, ids address, tensors
    to keep alive through the call). A float32 CPU tensor as it is (the C takes its top-k,
    through d2t: ids 0); elsewhere (a GPU, bfloat16) top_logprobs on its device, brought to the
    host in one copy."""
    view = layer_ops.rows_view(logits)
    if view is not None:
        return view, 0, logits
    val, idx = top_logprobs(logits, k, d2t)
    if not val.is_cpu:
        val, idx = host_copy(val, idx)
    return layer_ops.rows_view(val), idx.data_ptr(), (val, idx)


def host_copy(val: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """val float32 and idx int64, both [N, k], on a device -> the same on the host, contiguous,
    in one copy (one synchronisation): the ids and the values' bits as one int64 tensor."""
    n = idx.numel()
    both = torch.cat([idx.flatten(), val.contiguous().view(torch.int32).flatten().to(torch.int64)]).cpu()
    return both[n:].to(torch.int32).view(torch.float32).view(idx.shape), both[:n].view(idx.shape)


def sample(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """logits [N, V] float32 -> token ids [N] int64."""
    greedy_ids = row_argmax(apply_penalties(logits, b))
    if b.all_greedy:
        return greedy_ids
    probs = processed_probs(logits, b)
    noise = exponential_noise(b.seeds, b.positions, logits.shape[-1]).to(probs.dtype)
    sampled = row_argmax(probs / noise)
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
