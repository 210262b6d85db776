"""TritonAttention: the CUDA backend, the paged and tree attention kernels of specserve.kernels.

Scope: no gathering and no split by query length; the kernels read every request's context
through its block table. A step with a draft tree carries one packed mask for all its rows
(tree_mask.packed_step_mask: tree rows see their ancestors, other rows are causal) and runs the
tree kernel; any other step runs the paged kernel. Both also run on CPU under
TRITON_INTERPRET=1 (the tests do), or as their PyTorch references with SPECSERVE_KERNELS=torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.model import tree_mask

from .metadata import AttentionMetadata, StepIndex, TreeParents, to_device


@dataclass
class PagedMetadata(AttentionMetadata):
    """TritonAttention's metadata: the paged layout as the kernels read it (int32), and the
    packed mask of a tree step."""

    query_start_loc: torch.Tensor | None = None  # [B+1] int32: offsets of each request's tokens
    seq_lens: torch.Tensor | None = None  # [B] int32: context length including the new tokens
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    tree_mask: torch.Tensor | None = None  # [T, W] int32 packed bits (tree_mask.py); None: causal


def paged_metadata(cls, step: StepIndex, device: torch.device):
    """A step's paged layout as the kernels read it (int32), and its packed tree mask, in a
    `cls` (PagedMetadata or a subclass)."""
    meta = cls(**AttentionMetadata.common(step, device),
               query_start_loc=to_device(step.qsl, device, torch.int32),
               seq_lens=to_device(step.seq, device, torch.int32),
               block_tables=to_device(step.table, device, torch.int32))
    if step.tree_parents is not None:
        packed = tree_mask.packed_step_mask(step.tree_parents, step.qlen.tolist())
        meta.tree_mask = to_device(packed, device, torch.int32)
    return meta


class TritonAttention:
    """CUDA backend: the paged and tree attention kernels of specserve.kernels."""

    def build_metadata(self, seq_lens: list[int], query_lens: list[int], block_tables: list[list[int]],
                       block_size: int, device: torch.device,
                       tree_parents: TreeParents | None = None) -> PagedMetadata:
        """Host-side construction with numpy; one transfer per tensor."""
        return paged_metadata(PagedMetadata, StepIndex.build(seq_lens, query_lens, block_tables, block_size,
                                                             tree_parents), device)

    def __call__(self, q, k, v, k_cache, v_cache, meta: PagedMetadata, scale: float) -> torch.Tensor:
        from specserve import kernels  # imports triton when installed: only once a step runs

        kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.tree_mask is not None:
            return kernels.tree_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                          meta.query_start_loc, meta.tree_mask, scale,
                                          max_query_len=meta.max_query_len)
        return kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, scale,
                                       max_query_len=meta.max_query_len)
