"""Static step buffers: the inputs of a compiled or graph-captured step, sized once.

A step's inputs (token ids, positions, KV slots, block tables, context lengths, query starts,
packed tree masks) are written with numpy into host buffers allocated once (pinned on CUDA) and
copied into device buffers that never move, so that a CUDA graph captured over them replays any
later step of its bucket. Each step is padded to a bucket:

* requests to a batch-size bucket (`buckets`: 1, 2, 4, 8, 16, 24, 32, ...) and the longest
  query to a width bucket from the same list (1: a decode step; more: verify rows, or a short
  chunk), and tokens to requests x width;
* padding requests have one token and a context of one position, in the reserved null block
  (the block past the pool's last, which no request owns); padding tokens past them belong to
  no request (the kernels leave their rows alone, the dense op gives them some row). Every
  padding token writes its K/V into the null block, so padding never touches a request's cache;
  rows are independent through the whole model, so padding never changes a real row either.
* Block-table columns a request does not use keep stale block ids: valid blocks, never read
  (attention stops at the context length), so only the used columns are rewritten.
* Every step carries packed tree masks (tree_mask.py), causal rows where a request has no
  tree: decode and verify steps are one kind of step, one compiled graph, the tree kernel's
  (in a decode step each row's mask is its own bit).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.model import tree_mask as trees
from specserve.model.attention.ops import OpMetadata


def buckets(limit: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `limit` (which ends the list)."""
    out = [b for b in (1, 2, 4, 8) if b < limit]
    out += list(range(16, limit, 8))
    return out + [limit]


def bucket_of(sizes: Sequence[int], n: int) -> int | None:
    """The smallest bucket of `sizes` (ascending) that holds n, or None."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class Bucket:
    """A padded step's shape: requests, tokens (requests x width), the longest query, and the
    block-table columns the step's attention reads (None: all of them)."""

    reqs: int
    tokens: int
    width: int
    blocks: int | None = None


class StepBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, max_width: int,
                 block_size: int, null_block: int, device: torch.device, mask_width: int = 0) -> None:
        """mask_width: the tree masks hold the bits of max(max_width, mask_width) nodes."""
        self.max_tokens, self.max_blocks = max_tokens, max_blocks
        self.block_size, self.null_block = block_size, null_block
        self.null_slot = null_block * block_size
        self.words = trees.num_words(max(max_width, mask_width))
        shapes = {"ids": ((max_tokens,), torch.int64), "positions": ((max_tokens,), torch.int64),
                  "slots": ((max_tokens,), torch.int64),
                  "block_tables": ((max_seqs, max_blocks), torch.int32),
                  "seq_lens": ((max_seqs,), torch.int32), "query_start": ((max_seqs + 1,), torch.int32),
                  "tree_mask": ((max_tokens, self.words), torch.int32)}
        pin = device.type == "cuda"
        self.host = {k: torch.zeros(s, dtype=d, pin_memory=pin) for k, (s, d) in shapes.items()}
        self.host["block_tables"].fill_(null_block)
        self.np = {k: t.numpy() for k, t in self.host.items()}  # the same memory
        self.dev = ({k: t.to(device) for k, t in self.host.items()} if device.type != "cpu" else self.host)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        # packed causal rows of a chain of n nodes, per n (verify steps without a tree)
        self._chains = [np.zeros((0, self.words), np.int32)] + [
            trees.pack_bits(trees.ancestor_matrix(trees.chain_parents(n)), self.words)
            for n in range(1, max_width + 1)]

    def fill(self, bucket: Bucket, ids: Sequence[int], positions: Sequence[int], seq_lens: Sequence[int],
             query_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
             tree_parents: Sequence[Sequence[int] | None] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, OpMetadata]:
        """Write one step (B requests, T tokens, flattened as the runner does: positions are
        the rotary ones, tree nodes at prefix + depth) padded to `bucket`; -> the device views
        (ids [tokens], positions [tokens], metadata) the forward reads."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have left the host buffers
        h, bs = self.np, self.block_size
        num_reqs, num_tokens = len(seq_lens), len(ids)
        reqs, tokens, width = bucket.reqs, bucket.tokens, bucket.width
        if num_reqs > reqs or num_tokens > tokens or reqs + num_tokens - num_reqs > tokens:
            raise ValueError(f"a step of {num_reqs} requests and {num_tokens} tokens does not fit {bucket}")
        h["ids"][:num_tokens] = ids
        h["ids"][num_tokens:tokens] = 0
        h["positions"][:num_tokens] = positions
        h["positions"][num_tokens:tokens] = 0
        seq = np.asarray(seq_lens, dtype=np.int64)
        qlen = np.asarray(query_lens, dtype=np.int64)
        qsl = h["query_start"]
        qsl[0] = 0
        np.cumsum(qlen, out=qsl[1:num_reqs + 1])
        qsl[num_reqs + 1:reqs + 1] = num_tokens + np.arange(1, reqs - num_reqs + 1)  # padding: one each
        h["seq_lens"][:num_reqs] = seq
        h["seq_lens"][num_reqs:reqs] = 1
        table = h["block_tables"]
        used = max(len(t) for t in block_tables)
        table[:reqs, :used] = self.null_block
        for b, blocks in enumerate(block_tables):
            table[b, :len(blocks)] = blocks
        # KV slot of each token: its index position prefix + i (tree nodes too), in its request's blocks
        req = np.repeat(np.arange(num_reqs), qlen)
        pos = np.arange(num_tokens) + (seq - qlen - qsl[:num_reqs])[req]
        h["slots"][:num_tokens] = table[req, pos // bs].astype(np.int64) * bs + pos % bs
        h["slots"][num_tokens:tokens] = self.null_slot
        mask = h["tree_mask"]
        mask[:tokens] = 0
        if width == 1:  # a decode step: every row sees itself (and its prefix)
            mask[:tokens, 0] = 1
        else:
            for b, n in enumerate(query_lens):
                parents = tree_parents[b] if tree_parents is not None else None
                start = int(qsl[b])
                mask[start:start + n] = self._chains[n] if parents is None else trees.pack_bits(
                    trees.ancestor_matrix(parents), self.words)
            mask[num_tokens:num_tokens + reqs - num_reqs, 0] = 1  # padding requests: one node each
        return self._views(bucket)

    def _views(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, OpMetadata]:
        reqs, tokens = bucket.reqs, bucket.tokens
        d = self.dev
        if d is not self.host:  # one asynchronous copy per buffer, of the rows in use
            for name, rows in (("ids", tokens), ("positions", tokens), ("slots", tokens),
                               ("block_tables", reqs), ("seq_lens", reqs), ("query_start", reqs + 1),
                               ("tree_mask", tokens)):
                d[name][:rows].copy_(self.host[name][:rows], non_blocking=True)
            self._copied.record()
        meta = OpMetadata(slot_mapping=d["slots"][:tokens], max_query_len=bucket.width,
                          max_seq_len=self.max_blocks * self.block_size,
                          block_tables=d["block_tables"][:reqs, :bucket.blocks],
                          seq_lens=d["seq_lens"][:reqs], query_start_loc=d["query_start"][:reqs + 1],
                          tree_mask=d["tree_mask"][:tokens], uniform=True)
        return d["ids"][:tokens], d["positions"][:tokens], meta

    def fill_padding(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, OpMetadata]:
        """A step of padding only (for warm-up and graph capture): touches the null block only."""
        return self.fill(bucket, [0], [0], [1], [1], [[self.null_block]], None)
