"""The gathered layout shared by the CPU backends (TorchAttention, InvariantAttention).

Each request's context is gathered from the paged cache into one padded [B, L] batch and its
queries padded to [B, Q]; attention runs over that batch, then the rows are scattered back to
the step's token order. A step that mixes query lengths (a prefill chunk beside decodes and
verifies) is split by `split_by_query_len`: the K/V are written once and each group attends
on its own, so no decode row is padded to a prefill chunk's length. Padding never changes a
row's result, so the split keeps batch invariance.

This module only moves data (gather, scatter, write); the arithmetic is each backend's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

import numpy as np
import torch

from .metadata import AttentionMetadata, StepIndex, split_by_query_len, to_device


@dataclass
class GatheredMetadata(AttentionMetadata):
    """AttentionMetadata plus the gathered layout (None on a step split into parts)."""

    gather_slots: torch.Tensor | None = None  # [B, L] int64: slot of each context position (padded)
    query_dest: torch.Tensor | None = None  # [T] int64: row of each token in the padded [B*Q] batch
    # A step that mixes query lengths is split instead: (token rows [T_g], metadata) per group of
    # requests, and the backend attends group by group.
    parts: list[tuple[torch.Tensor, "GatheredMetadata"]] | None = None


M = TypeVar("M", bound=GatheredMetadata)


def build_in_parts(cls: type[M], step: StepIndex, device: torch.device,
                   build_one: Callable[[StepIndex], M], groups: list[list[int]] | None = None) -> M:
    """build_one(step), or one cls holding build_one(group) per group of requests (default:
    per query-length group, split_by_query_len)."""
    groups = groups or split_by_query_len(step.qlen)
    if groups is None or len(groups) == 1:
        return build_one(step)
    parts = []
    for g in groups:
        rows = np.concatenate([np.arange(step.qsl[b], step.qsl[b + 1]) for b in g])
        parts.append((to_device(rows, device), build_one(step.select(g))))
    return cls(**AttentionMetadata.common(step, device), parts=parts)


def gather_layout(step: StepIndex, device: torch.device, length: int) -> tuple[dict, np.ndarray]:
    """gather_slots ([B, length]) and query_dest of the padded [B*Q] layout as keyword
    arguments, and the context range [length]."""
    max_q = step.max_query
    ctx = np.arange(length)
    blocks = step.table.shape[1]
    bs = step.block_size
    gather = step.table[:, np.minimum(ctx // bs, blocks - 1)] * bs + ctx % bs
    gather = np.where(ctx[None, :] < step.seq[:, None], gather, 0)
    total = int(step.qsl[-1])
    dest = step.req_of_token * max_q + np.arange(total) - step.qsl[step.req_of_token]
    return dict(gather_slots=to_device(gather, device), query_dest=to_device(dest, device)), ctx


def write_and_attend(attend, q, k, v, k_cache, v_cache, meta: GatheredMetadata, scale: float) -> torch.Tensor:
    """Write the step's new K/V into the caches, then attend(q, k_cache, v_cache, meta, scale)
    over the whole step, or part by part when the metadata splits it (rows scattered back)."""
    # q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]
    num_kv, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv, head_dim).index_copy_(0, meta.slot_mapping, v)
    if meta.parts is None:
        return attend(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    for rows, sub in meta.parts:
        out.index_copy_(0, rows, attend(q.index_select(0, rows), k_cache, v_cache, sub, scale))
    return out


def gather_dense(q, k_cache, v_cache, meta: GatheredMetadata, with_values: bool = True,
                 contiguous: bool = True):
    """Gather each request's context: queries [B, Hkv, G*Q, D] and keys/values [B, Hkv, L, D]
    (G query heads per KV head folded into the row axis; values None without with_values;
    keys and values strided views of the gathered [B, L, Hkv, D] without `contiguous`)."""
    num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv
    num_reqs = meta.gather_slots.shape[0]
    max_q = meta.max_query_len
    keys = gather_context(k_cache, meta.gather_slots, contiguous)
    values = gather_context(v_cache, meta.gather_slots, contiguous) if with_values else None
    if q.shape[0] != num_reqs * max_q:
        q = q.new_zeros(num_reqs * max_q, q.shape[1], head_dim).index_copy_(0, meta.query_dest, q)
    # [B*Q, Hkv*G, D] -> [B, Hkv, G*Q, D]
    queries = q.view(num_reqs, max_q, num_kv, group, head_dim).permute(0, 2, 3, 1, 4)
    return queries.reshape(num_reqs, num_kv, group * max_q, head_dim), keys, values, group


def gather_context(cache: torch.Tensor, slots: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D] at slots [B, L] -> [B, Hkv, L, D]: contiguous, or
    a transposed view of the gathered [B, L, Hkv, D] (SDPA reads strides; the copy that
    `contiguous` makes cost more than the attention itself at 64 requests)."""
    num_kv, head_dim = cache.shape[2], cache.shape[3]
    flat = cache.view(-1, num_kv, head_dim).index_select(0, slots.reshape(-1))
    out = flat.view(*slots.shape, num_kv, head_dim).transpose(1, 2)
    return out.contiguous() if contiguous else out


def scatter_dense(out: torch.Tensor, meta: GatheredMetadata, group: int, total: int) -> torch.Tensor:
    """[B, Hkv, G*Q, D] -> [T, Hq, D] in the step's token order."""
    num_reqs, num_kv, _, head_dim = out.shape
    max_q = meta.max_query_len
    out = out.view(num_reqs, num_kv, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_reqs * max_q, num_kv * group, head_dim)
    return out.index_select(0, meta.query_dest) if total != num_reqs * max_q else out


def step_cached(meta: AttentionMetadata, key: tuple, build):
    """build(), once per step: values derived from the step's metadata that every layer uses."""
    cache = meta.__dict__.setdefault("_step_cache", {})
    if key not in cache:
        cache[key] = build()
    return cache[key]
