"""InvariantAttention: the CPU bfloat16 backend whose every query row is bitwise independent
of the batch, and its metadata (the "logical" key order).

Speculation is lossless only if the logits of a token are the same whether it is decoded
alone, verified behind a run of drafts, or verified as a tree node, and whatever other
requests share the step. Everything here serves that invariant (tests/test_invariance.py):
change the arithmetic only with those tests running on a CPU with native bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from specserve.model import tree_mask

from .gathered import (GatheredMetadata, build_in_parts, gather_context, gather_dense, gather_layout,
                       scatter_dense, step_cached, write_and_attend)
from .metadata import AttentionMetadata, StepIndex, TreeParents, to_device

KEY_CHUNK = 64  # InvariantAttention's reduction chunk over key positions


@dataclass
class LogicalMetadata(GatheredMetadata):
    """The gathered layout with keys in order of position as each query row sees them: a tree
    node at depth d sees positions up to prefix + d, its ancestors in depth order. Keys are
    padded to whole chunks of KEY_CHUNK, so the backend never copies K/V to pad them."""

    logical_mask: torch.Tensor | None = None  # [B, 1, Q, L] bool: logical key slot visible to the row
    logical_index: torch.Tensor | None = None  # [B, Q, L] int64 dense key per logical slot; None: identity
    logical_start: int = 0  # every row's logical order equals the dense one below this position


class _RowPlan(NamedTuple):
    """What InvariantAttention needs for a block of M query positions beside the data, built
    once per step: the blocked (masked-out) keys [B, 1, 1, M, L] and the number of leading
    chunks in dense (= logical) order. With trees, the tail chunks after those follow each
    position's logical order: `index` [B, 1, 1, M, tail keys] orders its scores (offset to
    the first tail key); `value_slots` [B, (shared + M * tail chunks) * CHUNK] are the cache
    slots of the shared value chunks and then of every position's own copy of the tail;
    `prob_chunks` gives each value chunk's key chunk, and `picks` the element (value chunk,
    row) of the flattened [value chunks * G*M] GEMM output that each (chunk, row) sums."""
    blocked: torch.Tensor
    shared: int
    index: torch.Tensor | None = None
    value_slots: torch.Tensor | None = None
    prob_chunks: torch.Tensor | None = None
    picks: torch.Tensor | None = None


class InvariantAttention:
    """CPU bfloat16 backend whose every query row is bitwise independent of the batch.

    SDPA's CPU kernel does not give that (its blocking and reductions follow the query and key
    counts), but oneDNN's bfloat16 GEMMs do: a row's result does not depend on the number of
    rows, of columns or of batch entries. So attention is written with those GEMMs and with
    reductions whose order depends only on key positions:

    * scores = q @ K^T in bfloat16, softmax in float32 over keys in position order; keys past
      a row's position get -inf, and the key axis is padded to a multiple of CHUNK so the
      softmax sums always run over whole vectors (extra exact zeros change nothing);
    * P @ V per chunk of CHUNK key positions (a GEMM with a fixed reduction length), and the
      chunk partials summed in an order fixed by chunk position (`_sum_chunks`), in which
      trailing all-zero chunks leave the total unchanged;
    * a tree node sees its ancestors at consecutive positions after the prefix (as plain
      decoding would have written them), so its scores past the tree's prefix are permuted
      into that order (`logical_index`), and so are its values: the chunks before the tree
      are shared by all rows, each tree position has its own copy of the chunks after, and
      one batched GEMM covers both.

    The same arithmetic in float32 is not invariant (MKL's sgemm takes different paths for
    1, 2-3 and 4+ rows), so float32 keeps TorchAttention.
    """

    CHUNK = KEY_CHUNK
    MAX_SCORES = 1 << 24  # score elements per block of query rows (bounds prefill memory)

    def build_metadata(self, seq_lens: list[int], query_lens: list[int], block_tables: list[list[int]],
                       block_size: int, device: torch.device,
                       tree_parents: TreeParents | None = None) -> LogicalMetadata:
        """Host-side construction with numpy; one transfer per tensor."""
        step = StepIndex.build(seq_lens, query_lens, block_tables, block_size, tree_parents)
        return build_in_parts(LogicalMetadata, step, device, lambda s: _build_logical(s, device))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: LogicalMetadata,
                 scale: float) -> torch.Tensor:
        return write_and_attend(self._attend, q, k, v, k_cache, v_cache, meta, scale)

    def _attend(self, q, k_cache, v_cache, meta: LogicalMetadata, scale: float) -> torch.Tensor:
        # the logical layout gathers keys pre-padded to whole chunks, always with a mask
        tree = meta.logical_index is not None  # values are gathered per block of rows, below
        queries, keys, values, group = gather_dense(q, k_cache, v_cache, meta, with_values=not tree)
        b, h, rows, d = queries.shape
        length, max_q = keys.shape[2], meta.max_query_len
        # blocks of query positions, each with its G folded heads: [B, H, G, Q, D]
        queries = queries.view(b, h, group, max_q, d)
        step = max(1, self.MAX_SCORES // (b * h * group * length))
        outs = []
        for r in range(0, max_q, step):
            sl = slice(r, min(max_q, r + step))
            plan = step_cached(meta, ("rows", group, sl.start, sl.stop),
                               lambda: self._plan(meta, sl, group, length))
            if tree:
                values = gather_context(v_cache, plan.value_slots)
            outs.append(self._rows(queries[:, :, :, sl], keys, values, plan, scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
        return scatter_dense(out.reshape(b, h, rows, d), meta, group, q.shape[0])

    def _plan(self, meta: LogicalMetadata, sl: slice, group: int, length: int) -> _RowPlan:
        blocked = ~meta.logical_mask[:, :, sl].unsqueeze(1)
        index = meta.logical_index
        c = self.CHUNK
        if index is None:
            return _RowPlan(blocked, length // c)
        shared, n = meta.logical_start // c, length // c
        tail = index[:, sl, shared * c:]  # [B, M, tail keys]
        b, m = tail.shape[:2]
        slots = meta.gather_slots
        slots = torch.cat([slots[:, :shared * c], slots.gather(1, tail.reshape(b, -1))], dim=1)
        # value chunks: the shared ones, then each position's own tail chunks; the probabilities
        # of a value chunk are those of its key chunk, for every row
        prob_chunks = torch.cat([torch.arange(shared), torch.arange(shared, n).repeat(m)])
        # row (g, j) takes the partial sums of chunk i from value chunk i (shared) or from
        # position j's own copy of it: element (value chunk, row) of the [chunks, G*M] output
        row_pos = torch.arange(m).repeat(group)
        chunk = torch.arange(n)[:, None].expand(n, group * m)
        chunk = torch.where(chunk < shared, chunk, chunk + row_pos[None, :] * (n - shared))
        picks = (chunk * group * m + torch.arange(group * m)).reshape(-1)
        to = tail.device
        return _RowPlan(blocked, shared, (tail - shared * c)[:, None, None], slots, prob_chunks.to(to), picks.to(to))

    def _rows(self, queries, keys, values, plan, scale):
        """Attention for queries [B, H, G, M, D] over keys [B, H, L, D] and values [B, H, L, D]
        (trees: [B, H, (shared + M * tail) * CHUNK, D], gathered at plan.value_slots)."""
        shared, index = plan.shared, plan.index
        b, h, g, m, d = queries.shape
        c = self.CHUNK
        n = keys.shape[2] // c
        scores = torch.matmul(queries.reshape(b, h, g * m, d), keys.transpose(-1, -2))
        scores = (scores.float() * scale).view(b, h, g, m, -1)  # [B, H, G, M, L]
        if index is not None:  # keys past the shared chunks in each row's logical order
            tail = scores[..., shared * c:]
            tail.copy_(tail.gather(-1, index.expand(b, h, g, m, -1)))
        scores = scores.masked_fill(plan.blocked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(queries.dtype)
        probs = probs.view(b, h, g * m, n, c).transpose(2, 3)  # [B, H, chunks, G*M, CHUNK]
        if index is None:  # one GEMM per chunk of CHUNK keys: [B, H, chunks, G*M, D]
            part = torch.matmul(probs, values.reshape(b, h, n, c, d))
        else:  # the shared value chunks, then every position's own tail chunks, in one batched
            # GEMM for every row; each row then keeps the partial sums of its own position's
            part = torch.matmul(probs.index_select(2, plan.prob_chunks), values.reshape(b, h, -1, c, d))
            part = part.view(b, h, -1, d).index_select(2, plan.picks).view(b, h, n, g * m, d)
        # chunk partials summed in an order fixed by chunk position (see _sum_chunks)
        out = _sum_chunks(part).to(queries.dtype)
        return out.view(b, h, g, m, d)


def _build_logical(step: StepIndex, device: torch.device) -> LogicalMetadata:
    # keys padded to whole chunks here, so the backend never copies K/V to pad them
    max_l = -(-step.max_seq // KEY_CHUNK) * KEY_CHUNK
    layout, ctx = gather_layout(step, device, max_l)
    meta = LogicalMetadata(**AttentionMetadata.common(step, device), **layout)
    num_reqs, max_q = len(step.seq), meta.max_query_len
    prefix, qlen = step.prefix, step.qlen
    q_pos = prefix[:, None] + np.arange(max_q)[None, :]  # [B, Q] position of each query row
    trees = [(b, p) for b, p in enumerate(step.tree_parents or []) if p is not None]
    if trees:
        index = np.broadcast_to(ctx, (num_reqs, max_q, max_l)).copy()
        for b, parents in trees:
            p0 = int(prefix[b])
            for i, path in enumerate(tree_mask.root_paths(parents)):  # the node's ancestors, root first
                q_pos[b, i] = p0 + len(path) - 1
                index[b, i, p0:p0 + len(path)] = p0 + np.asarray(path)
        meta.logical_index = to_device(index, device)
        meta.logical_start = int(min(prefix[b] for b, _ in trees))
    valid = np.arange(max_q)[None, :] < qlen[:, None]
    q_pos = np.where(valid, q_pos, 0)  # padded query rows see key 0 only: softmax stays finite
    meta.logical_mask = to_device(ctx[None, None, :] <= q_pos[:, :, None], device, torch.bool).unsqueeze(1)
    return meta


def _sum_chunks(part: torch.Tensor) -> torch.Tensor:
    """part [B, H, chunks, R, D] (bfloat16 partial sums per chunk of keys) -> [B, H, R, D] in
    float32. torch's CPU sum over an outer dimension whose inner extent is a multiple of the
    vector width adds runs of 16 chunks in order and then the runs in order: each value's order
    depends only on chunk positions, and trailing all-zero chunks (keys a row does not see)
    leave it unchanged, so a row's sum does not depend on the number of chunks or rows. (Head
    sizes that are not a multiple of 64 are padded to one: the vector paths then cover every
    column alike, whatever the number of rows.)"""
    pad = -part.shape[-1] % 64
    if pad:
        return F.pad(part, (0, pad)).sum(dim=2, dtype=torch.float32)[..., :part.shape[-1]]
    return part.sum(dim=2, dtype=torch.float32)
