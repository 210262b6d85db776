"""What every attention backend knows about a step: the flattened batch and its paged cache.

A step holds B requests whose T new tokens (prefill chunks, single decode tokens, or draft
tokens to verify) are concatenated without padding. Request b's new tokens are the last
q_len_b positions of its context of seq_lens[b] tokens; their K/V are written into the cache
at `slot_mapping` before attention reads the context back through the block table.

`StepIndex` is the host-side (numpy) form that each backend's `build_metadata` starts from;
`AttentionMetadata` holds the device tensors every backend reads. A backend's own metadata
extends it (sdpa.py, invariant.py, paged.py). Built once per step, shared by every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

TreeParents = Sequence[Sequence[int] | None]  # [B]: each request's parents (tree_mask.py) or None


@dataclass
class StepIndex:
    """The step's shape on the host, computed once with numpy (int64 throughout); read only."""

    seq: np.ndarray  # [B] context length of each request, new tokens included
    qlen: np.ndarray  # [B] new tokens of each request
    qsl: np.ndarray  # [B+1] offsets of each request's tokens in the flattened batch
    table: np.ndarray  # [B, max_blocks] block tables, zero-padded
    req_of_token: np.ndarray  # [T] request of each new token
    slots: np.ndarray  # [T] cache slot of each new token
    positions: np.ndarray  # [T] position of each new token in its request
    block_size: int
    tree_parents: list[list[int] | None] | None  # [B]; None when no request has a tree
    max_query: int  # the longest query (new tokens of a request)
    max_seq: int  # the longest context

    @staticmethod
    def build(seq_lens: Sequence[int], query_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
              block_size: int, tree_parents: TreeParents | None = None) -> "StepIndex":
        seq = np.array(seq_lens, dtype=np.int64)
        num_reqs, max_query = len(seq), max(query_lens)
        if max_query == 1:  # a decode step: one new token each
            qlen, qsl = np.ones(num_reqs, dtype=np.int64), np.arange(num_reqs + 1)
            req_of_token, pos = qsl[:-1], seq - 1
        else:
            qlen = np.array(query_lens, dtype=np.int64)
            qsl = np.zeros(num_reqs + 1, dtype=np.int64)
            qsl[1:] = qlen.cumsum()
            req_of_token = np.repeat(np.arange(num_reqs), qlen)
            pos = np.arange(int(qsl[-1])) + (seq - qlen - qsl[:-1])[req_of_token]
        width = max(map(len, block_tables))
        if all(len(t) == width for t in block_tables):
            table = np.array(block_tables, dtype=np.int64).reshape(num_reqs, width)
        else:
            table = np.zeros((num_reqs, width), dtype=np.int64)
            for i, t in enumerate(block_tables):
                table[i, :len(t)] = t
        # position p of request b lives in slot table[b, p // bs] * bs + p % bs
        block, offset = np.divmod(pos, block_size)
        slots = table[req_of_token, block] * block_size + offset
        has_tree = tree_parents is not None and any(p is not None for p in tree_parents)
        trees = [None if p is None else list(p) for p in tree_parents] if has_tree else None
        return StepIndex(seq, qlen, qsl, table, req_of_token, slots, pos, block_size, trees, max_query,
                         max(seq_lens))

    @property
    def prefix(self) -> np.ndarray:
        """[B] context before each request's new tokens."""
        return self.seq - self.qlen

    def select(self, reqs: Sequence[int]) -> "StepIndex":
        """The same step restricted to the requests `reqs` (in that order)."""
        seq_lens = self.seq[list(reqs)].tolist()
        query_lens = self.qlen[list(reqs)].tolist()
        tables = [self.table[b] for b in reqs]
        trees = [self.tree_parents[b] for b in reqs] if self.tree_parents is not None else None
        return StepIndex.build(seq_lens, query_lens, tables, self.block_size, trees)


def to_device(a: np.ndarray, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """One host-to-device transfer of a numpy array."""
    return torch.from_numpy(a).to(device=device, dtype=dtype)


@dataclass
class AttentionMetadata:
    """The fields every backend needs (a backend's own layout extends them)."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    max_query_len: int
    max_seq_len: int

    @staticmethod
    def common(step: StepIndex, device: torch.device) -> dict:
        """The common fields of `step` on `device`, as keyword arguments for any subclass."""
        return dict(slot_mapping=to_device(step.slots, device), max_query_len=step.max_query,
                    max_seq_len=step.max_seq)


class AttentionBackend(Protocol):
    """What the model calls: build the step's metadata once, then attend layer by layer."""

    def build_metadata(self, seq_lens: list[int], query_lens: list[int], block_tables: list[list[int]],
                       block_size: int, device: torch.device,
                       tree_parents: TreeParents | None = None) -> AttentionMetadata: ...

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], caches [num_blocks, block_size, Hkv, D] -> [T, Hq, D];
        k and v are written into the caches at meta.slot_mapping first."""
        ...


def split_by_query_len(qlen: np.ndarray) -> list[list[int]] | None:
    """Request groups for a step whose padding to the longest query would waste work: query
    lengths in ranges 1, 2-4, 5-16, 17-64, 65-256, ... (each padded at most 4x within its
    group), so decodes, verifies and prefill chunks do not pad to each other. None when one
    group holds everything (a plain decode step)."""
    if len(qlen) == 1 or qlen.min() == qlen.max():
        return None
    bucket = (np.ceil(np.log2(np.maximum(qlen, 1))) + 1) // 2  # 1 -> 0, 2-4 -> 1, 5-16 -> 2, ...
    keys = np.unique(bucket)
    if len(keys) == 1:
        return None
    return [np.flatnonzero(bucket == key).tolist() for key in keys]
