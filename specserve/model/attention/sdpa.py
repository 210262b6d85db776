"""TorchAttention: the CPU reference backend (float32 by default), one SDPA call per layer.

Scope: the gathered layout of gathered.py with a dense boolean mask in the gathered order:
each query row sees the context up to its own position (causal), and a tree node sees the
prefix, its ancestors and itself (tree_mask.py). Float32 through MKL is not row-invariant (1,
2-3 and 4+ rows take different GEMM kernels), so speculation on this backend is lossless up
to last-bit ties only; bfloat16 on CPU uses InvariantAttention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specserve.model import tree_mask

from .gathered import (GatheredMetadata, build_in_parts, gather_dense, gather_layout, scatter_dense,
                       step_cached, write_and_attend)
from .metadata import AttentionMetadata, StepIndex, TreeParents


@dataclass
class DenseMetadata(GatheredMetadata):
    """TorchAttention's metadata: the gathered layout and a mask in the gathered key order."""

    dense_mask: torch.Tensor | None = None  # [B, 1, Q, L] bool (None: every query sees every key)


class TorchAttention:
    """Reference backend: one SDPA call per layer over the gathered, padded context.

    GQA without copying K/V: the G query heads that share a KV head are folded into the
    query-length axis ([B, Hkv, G*Q, D] against [B, Hkv, L, D]), and the mask is repeated G
    times along that axis once per step.
    """

    def build_metadata(self, seq_lens: list[int], query_lens: list[int], block_tables: list[list[int]],
                       block_size: int, device: torch.device,
                       tree_parents: TreeParents | None = None) -> DenseMetadata:
        """Host-side construction with numpy; one transfer per tensor."""
        step = StepIndex.build(seq_lens, query_lens, block_tables, block_size, tree_parents)
        return build_in_parts(DenseMetadata, step, device, lambda s: _build_dense(s, device))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DenseMetadata,
                 scale: float) -> torch.Tensor:
        return write_and_attend(self._attend, q, k, v, k_cache, v_cache, meta, scale)

    @staticmethod
    def _attend(q, k_cache, v_cache, meta: DenseMetadata, scale: float) -> torch.Tensor:
        queries, keys, values, group = gather_dense(q, k_cache, v_cache, meta, contiguous=False)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=_mask_per_group(meta, group),
                                             scale=scale)
        return scatter_dense(out, meta, group, q.shape[0])


def _build_dense(step: StepIndex, device: torch.device, cls: type[DenseMetadata] = DenseMetadata) -> DenseMetadata:
    max_q, max_l = step.max_query, step.max_seq
    layout, ctx = gather_layout(step, device, max_l)
    meta = cls(**AttentionMetadata.common(step, device), **layout)
    seq, qlen, trees = step.seq, step.qlen, step.tree_parents
    if max_q > 1 or trees is not None or (seq != max_l).any():
        q_pos = step.prefix[:, None] + np.arange(max_q)[None, :]  # [B, Q]
        mask = ctx[None, None, :] <= q_pos[:, :, None]  # causal [B, Q, L]
        mask &= ctx[None, None, :] < seq[:, None, None]
        for b, parents in enumerate(trees or []):
            if parents is not None:  # tree rows see the prefix, their ancestors and themselves
                n, prefix = int(qlen[b]), int(step.prefix[b])
                mask[b, :n, prefix:prefix + n] = tree_mask.ancestor_matrix(parents)
        mask[:, :, 0] |= ~mask.any(-1)  # padded query rows: keep softmax finite
        meta.dense_mask = torch.from_numpy(mask).to(device=device, dtype=torch.bool).unsqueeze(1)
    return meta


def _mask_per_group(meta: DenseMetadata, group: int) -> torch.Tensor | None:
    """The step's dense_mask [B, 1, Q, L] repeated for the G folded query heads: [B, 1, G*Q, L].
    Built once per step, every layer reuses it."""
    if meta.dense_mask is None:
        return None
    return step_cached(meta, ("dense_mask", group), lambda: meta.dense_mask.repeat(1, 1, group, 1))
