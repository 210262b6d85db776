"""CPUPagedAttention: the CPU float32 backend; every row (decode, chain and tree rows, prefill
chunks) reads the paged cache in place (specserve/kernels/cpu/paged_attention.c).

The SDPA path (sdpa.py) gathers every request's context into a padded batch per layer and
step: at 64 requests of a few hundred tokens that copy costs more than the attention itself,
and its blocked products give a row other bits in a chunk of other length. The kernel reads
each key and value row where it lies, through the block table, and a row's result depends on
its own keys only. Masks as everywhere (tree_mask.py): a row sees its causal context, a tree
node the prefix, its ancestors and itself; the kernel takes them as a run of leading positions
plus, for tree nodes, the list of their ancestors' positions. A request's rows go to the
kernel in runs of at most KERNEL_MAX_QUERY (a prefill chunk: several runs, each with the
request's block table), so a prompt's keys and values are the same bits however it is chunked
or cached, and a verify row the bits of the same token's decode row however long its tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.kernels.cpu import cpu_attention
from specserve.model import tree_mask

from .metadata import AttentionMetadata, StepIndex, TreeParents, to_device

KERNEL_MAX_QUERY = cpu_attention.MAX_ROWS  # rows of one request in one of the kernel's runs


@dataclass
class CPUPagedMetadata(AttentionMetadata):
    """The kernel's fields: its runs of rows and every row's keys."""

    table: torch.Tensor  # [S, max_blocks] int64: each run's request's block table
    query_start: torch.Tensor  # [S + 1] int64: each run's first token
    dense: torch.Tensor  # [T] int64: leading context positions the token sees
    extra_ptr: torch.Tensor  # [T + 1] int64: its further positions in extra_pos
    extra_pos: torch.Tensor  # a tree node's ancestors' and its own positions
    max_keys: int = 0


class CPUPagedAttention:
    def build_metadata(self, seq_lens: list[int], query_lens: list[int], block_tables: list[list[int]],
                       block_size: int, device: torch.device,
                       tree_parents: TreeParents | None = None) -> CPUPagedMetadata:
        return _build_paged(StepIndex.build(seq_lens, query_lens, block_tables, block_size, tree_parents), device)

    def __call__(self, q, k, v, k_cache, v_cache, meta: CPUPagedMetadata, scale: float) -> torch.Tensor:
        """The step's new K/V written to their slots and every row attended, in one call."""
        return cpu_attention.paged_attention(q, k_cache, v_cache, meta.table, meta.query_start, meta.dense,
                                             meta.extra_ptr, meta.extra_pos, meta.max_keys, scale,
                                             k, v, meta.slot_mapping)


def _runs(step: StepIndex) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's (block table rows [S, max_blocks], query_start [S + 1]) with every
    request's rows cut into runs of at most KERNEL_MAX_QUERY (a long query: several runs, each
    with the request's table). A row's keys are its own positions, so its result does not
    depend on the run it is in."""
    if step.max_query <= KERNEL_MAX_QUERY:
        return step.table, step.qsl
    runs = -(-step.qlen // KERNEL_MAX_QUERY)
    owner = np.repeat(np.arange(len(step.qlen)), runs)
    first = step.qsl[:-1][owner] + KERNEL_MAX_QUERY * (np.arange(len(owner)) - np.repeat(runs.cumsum() - runs, runs))
    return step.table[owner], np.append(first, step.qsl[-1])


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
    table, query_start = _runs(step)
    return CPUPagedMetadata(**AttentionMetadata.common(step, device),
                            table=to_device(table, device), query_start=to_device(query_start, device),
                            dense=to_device(dense, device), extra_ptr=to_device(ptr, device),
                            extra_pos=to_device(np.array(extra, dtype=np.int64), device), max_keys=max_keys)
