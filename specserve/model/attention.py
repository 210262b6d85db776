"""Attention over the paged KV cache for a flattened batch of requests.

`AttentionMetadata` is built once per step by the model runner and shared by every layer. It
describes B requests whose T new tokens (prefill chunks, single decode tokens, or draft tokens
to verify) are concatenated without padding. Request b's new tokens are the last q_len_b
positions of its context of seq_lens[b] tokens; their K/V are written into the cache at
`slot_mapping` before attention reads the context back through the block table.

Masks: by default each new token sees the context up to its own position (causal). When a
request's new tokens form a draft tree, `tree_parents` gives each node's parent (local index,
-1 for a root that hangs off the prefix) and a node sees the prefix, its ancestors and itself.

Backends (same interface, chosen by `get_attention_backend`):
  * `TorchAttention`: the CPU reference. It gathers every request's context into one padded
    [B, L] batch and runs one SDPA call per layer with a dense boolean mask.
  * `TritonAttention`: the kernels in specserve/kernels (CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specserve.config import env_str


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [B+1] int32: offsets of each request's tokens in the batch
    seq_lens: torch.Tensor  # [B] int32: context length including the new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    # Dense layout for the torch backend (None when the Triton backend runs):
    gather_slots: torch.Tensor | None = None  # [B, L] int64: slot of each context position (padded)
    query_dest: torch.Tensor | None = None  # [T] int64: row of each token in the padded [B*Q] batch
    dense_mask: torch.Tensor | None = None  # [B, 1, Q, L] bool (None: every query sees every key)
    tree_mask: torch.Tensor | None = None  # [T, W] int32 packed bits for the Triton tree kernel

    @staticmethod
    def build(seq_lens: list[int], query_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device, dense: bool,
              tree_parents: list[list[int] | None] | None = None) -> "AttentionMetadata":
        """Host-side construction with numpy; one transfer per tensor."""
        seq = np.asarray(seq_lens, dtype=np.int64)
        qlen = np.asarray(query_lens, dtype=np.int64)
        num_reqs = len(seq_lens)
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(qlen, out=qsl[1:])
        max_blocks = max(len(t) for t in block_tables)
        table = np.zeros((num_reqs, max_blocks), dtype=np.int64)
        for i, t in enumerate(block_tables):
            table[i, :len(t)] = t
        # slot of each new token: position p of request b lives in table[b, p // bs] * bs + p % bs
        req_of_token = np.repeat(np.arange(num_reqs), qlen)
        pos = np.arange(int(qsl[-1])) - qsl[req_of_token] + (seq - qlen)[req_of_token]
        slots = table[req_of_token, pos // block_size] * block_size + pos % block_size
        as_t = lambda a, dt=torch.int64: torch.from_numpy(a).to(device=device, dtype=dt)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=as_t(slots),
            query_start_loc=as_t(qsl, torch.int32),
            seq_lens=as_t(seq, torch.int32),
            block_tables=as_t(table, torch.int32),
            max_query_len=int(qlen.max()),
            max_seq_len=int(seq.max()),
        )
        has_tree = tree_parents is not None and any(p is not None for p in tree_parents)
        if dense:
            max_q, max_l = meta.max_query_len, meta.max_seq_len
            ctx = np.arange(max_l)
            gather = table[:, np.minimum(ctx // block_size, max_blocks - 1)] * block_size + ctx % block_size
            gather = np.where(ctx[None, :] < seq[:, None], gather, 0)
            meta.gather_slots = as_t(gather)
            meta.query_dest = as_t(req_of_token * max_q + np.arange(int(qsl[-1])) - qsl[req_of_token])
            if max_q > 1 or has_tree or (seq != max_l).any():
                q_pos = (seq - qlen)[:, None] + np.arange(max_q)[None, :]  # [B, Q]
                mask = ctx[None, None, :] <= q_pos[:, :, None]  # causal [B, Q, L]
                mask &= ctx[None, None, :] < seq[:, None, None]
                if has_tree:
                    _apply_tree(mask, tree_parents, seq, qlen)
                mask[:, :, 0] |= ~mask.any(-1)  # padded query rows: keep softmax finite
                meta.dense_mask = as_t(mask, torch.bool).unsqueeze(1)
        elif has_tree:
            meta.tree_mask = _packed_tree_mask(tree_parents, qlen, device)
        return meta


def _ancestor_matrix(parents: list[int]) -> np.ndarray:
    n = len(parents)
    anc = np.eye(n, dtype=bool)
    for i, p in enumerate(parents):  # parents precede children, so one pass suffices
        if p >= 0:
            anc[i] |= anc[p]
    return anc


def _apply_tree(mask: np.ndarray, tree_parents, seq: np.ndarray, qlen: np.ndarray) -> None:
    for b, parents in enumerate(tree_parents):
        if parents is None:
            continue
        n = int(qlen[b])
        prefix = int(seq[b]) - n
        mask[b, :n, prefix:prefix + n] = _ancestor_matrix(parents)


def _packed_tree_mask(tree_parents, qlen: np.ndarray, device) -> torch.Tensor:
    words = (int(qlen.max()) + 31) // 32
    rows = []
    for b, parents in enumerate(tree_parents):
        n = int(qlen[b])
        anc = _ancestor_matrix(parents) if parents is not None else np.tril(np.ones((n, n), bool))
        padded = np.zeros((n, words * 32), dtype=bool)
        padded[:, :n] = anc
        bits = (padded.reshape(n, words, 32) * (1 << np.arange(32, dtype=np.int64))).sum(-1)
        rows.append(bits.astype(np.uint32).view(np.int32))
    return torch.from_numpy(np.concatenate(rows)).to(device)


class TorchAttention:
    """Reference backend: one SDPA call per layer over the gathered, padded context.

    GQA without copying K/V: the G query heads that share a KV head are folded into the
    query-length axis ([B, Hkv, G*Q, D] against [B, Hkv, L, D]), and the mask is repeated G
    times along that axis once per step.
    """

    dense = True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]
        num_kv, head_dim = k.shape[1], k.shape[2]
        group = q.shape[1] // num_kv
        flat_k = k_cache.view(-1, num_kv, head_dim)
        flat_v = v_cache.view(-1, num_kv, head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)
        num_reqs, max_l = meta.gather_slots.shape
        max_q, total = meta.max_query_len, q.shape[0]
        slots = meta.gather_slots.view(-1)
        keys = flat_k.index_select(0, slots).view(num_reqs, max_l, num_kv, head_dim).transpose(1, 2).contiguous()
        values = flat_v.index_select(0, slots).view(num_reqs, max_l, num_kv, head_dim).transpose(1, 2).contiguous()
        padded = total != num_reqs * max_q
        if padded:
            q = q.new_zeros(num_reqs * max_q, q.shape[1], head_dim).index_copy_(0, meta.query_dest, q)
        # [B*Q, Hkv*G, D] -> [B, Hkv, G*Q, D]
        queries = q.view(num_reqs, max_q, num_kv, group, head_dim).permute(0, 2, 3, 1, 4)
        queries = queries.reshape(num_reqs, num_kv, group * max_q, head_dim)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=_group_mask(meta, group),
                                             scale=scale)
        out = out.view(num_reqs, num_kv, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(num_reqs * max_q, num_kv * group, head_dim)
        return out.index_select(0, meta.query_dest) if padded else out


def _group_mask(meta: AttentionMetadata, group: int) -> torch.Tensor | None:
    if meta.dense_mask is None:
        return None
    cached = getattr(meta, "_group_mask", None)
    if cached is None or cached[0] != group:
        cached = (group, meta.dense_mask.repeat(1, 1, group, 1))  # [B, 1, G*Q, L]
        meta._group_mask = cached
    return cached[1]


class TritonAttention:
    """CUDA backend: the paged and tree attention kernels of specserve.kernels."""

    dense = False

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        from specserve import kernels

        kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.tree_mask is not None:
            return kernels.tree_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                          meta.query_start_loc, meta.tree_mask, scale,
                                          max_query_len=meta.max_query_len)
        return kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, scale,
                                       max_query_len=meta.max_query_len)


def get_attention_backend(device: torch.device):
    choice = env_str("ATTENTION_BACKEND", "auto")
    if choice == "torch" or (choice == "auto" and device.type != "cuda"):
        return TorchAttention()
    return TritonAttention()
