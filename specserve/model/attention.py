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
  * `InvariantAttention`: the CPU backend for bfloat16. Same gathered layout, but every query
    row's result is bitwise independent of the batch around it (how many rows, how many keys,
    whether it is a decode token, a draft to verify or a tree node), which is what makes
    speculation exactly lossless in bfloat16. See its docstring.
  * `TritonAttention`: the kernels in specserve/kernels (CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from specserve.config import env_str


KEY_CHUNK = 64  # InvariantAttention's reduction chunk over key positions


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
    # Logical layout (InvariantAttention): keys in order of position as each query row sees them
    logical_index: torch.Tensor | None = None  # [B, Q, L] int64 dense key per logical slot; None: identity
    logical_start: int = 0  # every row's logical order equals the dense one below this position
    tree_mask: torch.Tensor | None = None  # [T, W] int32 packed bits for the Triton tree kernel
    # Dense and logical layouts pad every request's queries to max_query_len. A step that mixes
    # a prefill chunk with decodes is split instead: (token rows [T_g], metadata) per group of
    # requests, and the backend attends group by group (see split_by_query_len).
    parts: list[tuple[torch.Tensor, "AttentionMetadata"]] | None = None

    @staticmethod
    def build(seq_lens: list[int], query_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device, layout: str,
              tree_parents: list[list[int] | None] | None = None) -> "AttentionMetadata":
        """Host-side construction with numpy; one transfer per tensor.

        layout: the backend's: "paged" (block tables only), "dense" (gathered context and a
        mask in the gathered order) or "logical" (gathered context, and a mask and key order by
        position: a tree node at depth d sees positions up to prefix + d, its ancestors in
        depth order).
        """
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
        groups = split_by_query_len(qlen) if layout in ("dense", "logical") else None
        if groups is not None:
            meta.parts = []
            for g in groups:
                rows = np.concatenate([np.arange(qsl[b], qsl[b + 1]) for b in g])
                sub = AttentionMetadata.build(
                    [seq_lens[b] for b in g], [query_lens[b] for b in g], [block_tables[b] for b in g],
                    block_size, device, layout, [tree_parents[b] for b in g] if has_tree else None)
                meta.parts.append((as_t(rows), sub))
        elif layout == "logical":
            _logical_layout(meta, table, seq, qlen, req_of_token, qsl, block_size, tree_parents,
                            as_t)
        elif layout == "dense":
            ctx = _gather_layout(meta, table, seq, req_of_token, qsl, block_size, as_t)
            max_q, max_l = meta.max_query_len, meta.max_seq_len
            if max_q > 1 or has_tree or (seq != max_l).any():
                q_pos = (seq - qlen)[:, None] + np.arange(max_q)[None, :]  # [B, Q]
                mask = ctx[None, None, :] <= q_pos[:, :, None]  # causal [B, Q, L]
                mask &= ctx[None, None, :] < seq[:, None, None]
                if has_tree:
                    _apply_tree(mask, tree_parents, seq, qlen)
                mask[:, :, 0] |= ~mask.any(-1)  # padded query rows: keep softmax finite
                meta.dense_mask = as_t(mask, torch.bool).unsqueeze(1)
        elif layout == "paged" and has_tree:
            meta.tree_mask = _packed_tree_mask(tree_parents, qlen, device)
        return meta


def split_by_query_len(qlen: np.ndarray) -> list[list[int]] | None:
    """Request groups for a step whose padding to the longest query would waste work: query
    lengths in ranges 1, 2-4, 5-16, 17-64, 65-256, ... (each padded at most 4x within its
    group), so decodes, verifies and prefill chunks do not pad to each other. None when one
    group holds everything (a plain decode step)."""
    bucket = (np.ceil(np.log2(np.maximum(qlen, 1))) + 1) // 2  # 1 -> 0, 2-4 -> 1, 5-16 -> 2, ...
    keys = np.unique(bucket)
    if len(keys) == 1:
        return None
    return [np.flatnonzero(bucket == key).tolist() for key in keys]


def _gather_layout(meta: AttentionMetadata, table: np.ndarray, seq: np.ndarray,
                   req_of_token: np.ndarray, qsl: np.ndarray, block_size: int, as_t,
                   length: int | None = None) -> np.ndarray:
    """gather_slots ([B, length], default length max_seq_len) and query_dest of the padded
    [B*Q] layout; returns the context range."""
    max_q = meta.max_query_len
    ctx = np.arange(length or meta.max_seq_len)
    blocks = table.shape[1]
    gather = table[:, np.minimum(ctx // block_size, blocks - 1)] * block_size + ctx % block_size
    gather = np.where(ctx[None, :] < seq[:, None], gather, 0)
    meta.gather_slots = as_t(gather)
    meta.query_dest = as_t(req_of_token * max_q + np.arange(int(qsl[-1])) - qsl[req_of_token])
    return ctx


def _logical_layout(meta, table, seq, qlen, req_of_token, qsl, block_size, tree_parents, as_t):
    # keys padded to whole chunks here, so the backend never copies K/V to pad them
    max_l = -(-meta.max_seq_len // KEY_CHUNK) * KEY_CHUNK
    ctx = _gather_layout(meta, table, seq, req_of_token, qsl, block_size, as_t, max_l)
    num_reqs, max_q = len(seq), meta.max_query_len
    prefix = seq - qlen
    q_pos = prefix[:, None] + np.arange(max_q)[None, :]  # [B, Q] position of each query row
    trees = [(b, p) for b, p in enumerate(tree_parents or []) if p is not None]
    if trees:
        index = np.broadcast_to(ctx, (num_reqs, max_q, max_l)).copy()
        for b, parents in trees:
            p0 = int(prefix[b])
            for i, path in enumerate(_root_paths(parents)):  # path: the node's ancestors, root first
                q_pos[b, i] = p0 + len(path) - 1
                index[b, i, p0:p0 + len(path)] = p0 + np.asarray(path)
        meta.logical_index = as_t(index)
        meta.logical_start = int(min(prefix[b] for b, _ in trees))
    valid = np.arange(max_q)[None, :] < qlen[:, None]
    q_pos = np.where(valid, q_pos, 0)  # padded query rows see key 0 only: softmax stays finite
    meta.dense_mask = as_t(ctx[None, None, :] <= q_pos[:, :, None], torch.bool).unsqueeze(1)


def _root_paths(parents: list[int]) -> list[list[int]]:
    paths: list[list[int]] = []
    for i, p in enumerate(parents):  # parents precede children
        paths.append((paths[p] if p >= 0 else []) + [i])
    return paths


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


class TorchAttention:
    """Reference backend: one SDPA call per layer over the gathered, padded context.

    GQA without copying K/V: the G query heads that share a KV head are folded into the
    query-length axis ([B, Hkv, G*Q, D] against [B, Hkv, L, D]), and the mask is repeated G
    times along that axis once per step.
    """

    layout = "dense"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float) -> torch.Tensor:
        return _attend_dense(self._attend, q, k, v, k_cache, v_cache, meta, scale)

    @staticmethod
    def _attend(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        queries, keys, values, group = _gather_dense(q, k_cache, v_cache, meta)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=_mask_per_group(meta, group),
                                             scale=scale)
        return _scatter_dense(out, meta, group, q.shape[0])


class InvariantAttention:
    """CPU bfloat16 backend whose every query row is bitwise independent of the batch.

    Speculation is lossless only if the logits of a token are the same whether it is decoded
    alone, verified behind a run of drafts, or verified as a tree node, and whatever other
    requests share the step. SDPA's CPU kernel does not give that (its blocking and reductions
    follow the query and key counts), but oneDNN's bfloat16 GEMMs do: a row's result does not
    depend on the number of rows, of columns or of batch entries (tests/test_invariance.py
    checks this on the machine that runs the suite). So attention is written with those GEMMs
    and with reductions whose order depends only on key positions:

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

    layout = "logical"
    CHUNK = KEY_CHUNK
    MAX_SCORES = 1 << 24  # score elements per block of query rows (bounds prefill memory)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float) -> torch.Tensor:
        return _attend_dense(self._attend, q, k, v, k_cache, v_cache, meta, scale)

    def _attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # the "logical" layout gathers keys pre-padded to whole chunks, always with a mask
        tree = meta.logical_index is not None  # values are gathered per block of rows, below
        queries, keys, values, group = _gather_dense(q, k_cache, v_cache, meta, with_values=not tree)
        b, h, rows, d = queries.shape
        length, max_q = keys.shape[2], meta.max_query_len
        # blocks of query positions, each with its G folded heads: [B, H, G, Q, D]
        queries = queries.view(b, h, group, max_q, d)
        step = max(1, self.MAX_SCORES // (b * h * group * length))
        outs = []
        for r in range(0, max_q, step):
            sl = slice(r, min(max_q, r + step))
            plan = _step_cached(meta, ("rows", group, sl.start, sl.stop),
                                lambda: self._plan(meta, sl, group, length))
            if tree:
                values = _gather_context(v_cache, plan.value_slots)
            outs.append(self._rows(queries[:, :, :, sl], keys, values, plan, scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
        return _scatter_dense(out.reshape(b, h, rows, d), meta, group, q.shape[0])

    def _plan(self, meta: AttentionMetadata, sl: slice, group: int, length: int) -> "_RowPlan":
        blocked = ~meta.dense_mask[:, :, sl].unsqueeze(1)
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


def _attend_dense(attend, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
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


def _gather_dense(q, k_cache, v_cache, meta: AttentionMetadata, with_values: bool = True):
    """Gather each request's context: queries [B, Hkv, G*Q, D] and keys/values [B, Hkv, L, D]
    (G query heads per KV head folded into the row axis; values None without with_values)."""
    num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv
    num_reqs = meta.gather_slots.shape[0]
    max_q = meta.max_query_len
    keys = _gather_context(k_cache, meta.gather_slots)
    values = _gather_context(v_cache, meta.gather_slots) if with_values else None
    if q.shape[0] != num_reqs * max_q:
        q = q.new_zeros(num_reqs * max_q, q.shape[1], head_dim).index_copy_(0, meta.query_dest, q)
    # [B*Q, Hkv*G, D] -> [B, Hkv, G*Q, D]
    queries = q.view(num_reqs, max_q, num_kv, group, head_dim).permute(0, 2, 3, 1, 4)
    return queries.reshape(num_reqs, num_kv, group * max_q, head_dim), keys, values, group


def _gather_context(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D] at slots [B, L] -> [B, Hkv, L, D], contiguous."""
    num_kv, head_dim = cache.shape[2], cache.shape[3]
    flat = cache.view(-1, num_kv, head_dim).index_select(0, slots.reshape(-1))
    return flat.view(*slots.shape, num_kv, head_dim).transpose(1, 2).contiguous()


def _scatter_dense(out: torch.Tensor, meta: AttentionMetadata, group: int, total: int) -> torch.Tensor:
    """[B, Hkv, G*Q, D] -> [T, Hq, D] in the step's token order."""
    num_reqs, num_kv, _, head_dim = out.shape
    max_q = meta.max_query_len
    out = out.view(num_reqs, num_kv, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_reqs * max_q, num_kv * group, head_dim)
    return out.index_select(0, meta.query_dest) if total != num_reqs * max_q else out


def _mask_per_group(meta: AttentionMetadata, group: int) -> torch.Tensor | None:
    """The step's dense_mask [B, 1, Q, L] repeated for the G folded query heads: [B, 1, G*Q, L].
    Built once per step, every layer reuses it."""
    if meta.dense_mask is None:
        return None
    return _step_cached(meta, ("dense_mask", group), lambda: meta.dense_mask.repeat(1, 1, group, 1))


def _step_cached(meta: AttentionMetadata, key: tuple, build):
    """build(), once per step: values derived from the step's metadata that every layer uses."""
    cache = meta.__dict__.setdefault("_step_cache", {})
    if key not in cache:
        cache[key] = build()
    return cache[key]


class TritonAttention:
    """CUDA backend: the paged and tree attention kernels of specserve.kernels."""

    layout = "paged"

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


def get_attention_backend(device: torch.device, dtype: torch.dtype = torch.float32):
    """SPECSERVE_ATTENTION_BACKEND = auto | torch | invariant | triton. auto: Triton on CUDA;
    on CPU the invariant backend for bfloat16 and SDPA (TorchAttention) otherwise."""
    choice = env_str("ATTENTION_BACKEND", "auto")
    if choice == "auto":
        if device.type == "cuda":
            choice = "triton"
        else:
            choice = "invariant" if dtype == torch.bfloat16 else "torch"
    backends = {"torch": TorchAttention, "invariant": InvariantAttention, "triton": TritonAttention}
    if choice not in backends:
        raise ValueError(f"SPECSERVE_ATTENTION_BACKEND: expected auto, torch, invariant or triton, "
                         f"got {choice!r}")
    return backends[choice]()
