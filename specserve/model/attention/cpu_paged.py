"""CPUPagedAttention: the CPU float32 backend; decode and verify rows read the paged cache in
place (specserve/kernels/cpu/paged_attention.c), prefill chunks take TorchAttention's SDPA path.

The SDPA path gathers every request's context into a padded batch per layer and step: at 64
requests of a few hundred tokens that copy costs more than the attention itself. The kernel
reads each key and value row where it lies, through the block table. Masks as everywhere
(tree_mask.py): a row sees its causal context, a tree node the prefix, its ancestors and
itself; the kernel takes them as a run of leading positions plus, for tree nodes, the list
of their ancestors' positions. Query groups longer than KERNEL_MAX_QUERY (prefill chunks,
where SDPA's blocked GEMMs win) go through the SDPA path, split from the rest as there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.kernels.cpu import cpu_attention
from specserve.model import tree_mask

from .gathered import build_in_parts
from .metadata import AttentionMetadata, StepIndex, TreeParents, split_by_query_len, to_device
from .sdpa import DenseMetadata, TorchAttention, _build_dense

KERNEL_MAX_QUERY = cpu_attention.MAX_ROWS  # longest query (new tokens of a request) the kernel takes


@dataclass
class CPUPagedMetadata(DenseMetadata):
    """DenseMetadata (SDPA groups) or the kernel's fields (decode and verify rows)."""

    table: torch.Tensor | None = None  # [B, max_blocks] int64
    query_start: torch.Tensor | None = None  # [B + 1] int64: each request's first token
    dense: torch.Tensor | None = None  # [T] int64: leading context positions the token sees
    extra_ptr: torch.Tensor | None = None  # [T + 1] int64: its further positions in extra_pos
    extra_pos: torch.Tensor | None = None  # a tree node's ancestors' and its own positions
    max_keys: int = 0


class CPUPagedAttention(TorchAttention):
    def build_metadata(self, seq_lens: list[int], query_lens: list[int], block_tables: list[list[int]],
                       block_size: int, device: torch.device,
                       tree_parents: TreeParents | None = None) -> CPUPagedMetadata:
        step = StepIndex.build(seq_lens, query_lens, block_tables, block_size, tree_parents)
        if step.max_query <= KERNEL_MAX_QUERY:
            return _build_paged(step, device)
        short = step.qlen <= KERNEL_MAX_QUERY
        long = np.flatnonzero(~short)  # the kernel's rows in one part, the rest by query length
        groups = [[int(long[i]) for i in g] for g in split_by_query_len(step.qlen[long]) or [range(len(long))]]
        return build_in_parts(CPUPagedMetadata, step, device,
                              lambda s: _build_paged(s, device) if s.max_query <= KERNEL_MAX_QUERY
                              else _build_dense(s, device, CPUPagedMetadata),
                              ([np.flatnonzero(short).tolist()] if short.any() else []) + groups)

    def __call__(self, q, k, v, k_cache, v_cache, meta: CPUPagedMetadata, scale: float) -> torch.Tensor:
        if meta.parts is None and meta.query_start is not None:  # the kernel's rows only: it writes the K/V too
            return cpu_attention.paged_attention(q, k_cache, v_cache, meta.table, meta.query_start, meta.dense,
                                                 meta.extra_ptr, meta.extra_pos, meta.max_keys, scale,
                                                 k, v, meta.slot_mapping)
        return super().__call__(q, k, v, k_cache, v_cache, meta, scale)

    @staticmethod
    def _attend(q, k_cache, v_cache, meta: CPUPagedMetadata, scale: float) -> torch.Tensor:
        """One part of the step (TorchAttention.__call__ writes the K/V and splits the parts)."""
        if meta.query_start is None:
            return TorchAttention._attend(q, k_cache, v_cache, meta, scale)
        return cpu_attention.paged_attention(q, k_cache, v_cache, meta.table, meta.query_start, meta.dense,
                                             meta.extra_ptr, meta.extra_pos, meta.max_keys, scale)


def _build_paged(step: StepIndex, device: torch.device) -> CPUPagedMetadata:
    num_tokens = len(step.slots)
    dense = step.positions + 1  # causal: up to its own position
    ptr = np.zeros(num_tokens + 1, dtype=np.int64)
    extra: list[int] = []  # in token order: requests in order, each tree's nodes in order
    max_keys = step.max_seq
    if step.tree_parents is not None:
        prefix, counts = step.prefix, np.zeros(num_tokens, dtype=np.int64)
        for b, parents in enumerate(step.tree_parents):
            if parents is None:
                continue
            p0, first = int(prefix[b]), int(step.qsl[b])
            for i, path in enumerate(tree_mask.root_paths(parents)):
                dense[first + i], counts[first + i] = p0, len(path)
                extra += [p0 + a for a in path]
        ptr[1:] = counts.cumsum()
        max_keys = int((dense + counts).max())
    return CPUPagedMetadata(**AttentionMetadata.common(step, device),
                            table=to_device(step.table, device), query_start=to_device(step.qsl, device),
                            dense=to_device(dense, device), extra_ptr=to_device(ptr, device),
                            extra_pos=to_device(np.array(extra, dtype=np.int64), device), max_keys=max_keys)
