"""Draft trees in a step: the one definition of their rows, positions and masks.

Convention (used by the runner, every attention backend and the Triton tree kernel's helpers):

* A request's verify rows are the nodes 0..n-1 of a tree, in the step's token order: its last
  committed token as the root (parent -1), then the draft nodes. `parents[i]` is node i's
  parent as a local index, or -1 for a node that hangs off the committed prefix; parents come
  before their children (`parents[i] < i`), so one pass in index order sees every ancestor
  first. A chain (`[-1, 0, 1, ...]`) is the ordinary causal case; several -1 entries (a
  forest) are allowed and mean several nodes that each see only the prefix and themselves.
* Node i sits at position `prefix + depth(i)`: where plain decoding of its path would have put
  it, so rotary embeddings and the bits of the logical-order attention match that decoding.
* Node i sees every prefix position, itself and its ancestors: row i of the ancestor matrix.
* The Triton tree kernel reads that matrix packed into int32 words [n, W]: bit j % 32 of word
  j // 32 is column j (two's complement, so bit 31 makes a word negative), W = ceil(width / 32)
  and bits at or past a request's own node count are zero.

Host-side numpy only: trees are tens of nodes, built once per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

WORD_BITS = 32


def check_parents(parents: Sequence[int]) -> list[int]:
    """parents as plain ints, or ValueError when they break the convention above."""
    out = [int(p) for p in parents]
    for i, p in enumerate(out):
        if p >= i:
            raise ValueError(f"parent {p} of node {i} must have a smaller index")
        if p < -1:
            raise ValueError(f"invalid parent {p} for node {i}")
    return out


def chain_parents(n: int) -> list[int]:
    """The tree of n causal rows: node i's parent is i - 1."""
    return list(range(-1, n - 1))


def depths(parents: Sequence[int]) -> np.ndarray:
    """int64 [n]: each node's depth (0 for a node that hangs off the prefix)."""
    out = np.zeros(len(parents), dtype=np.int64)
    for i, p in enumerate(check_parents(parents)):
        if p >= 0:
            out[i] = out[p] + 1
    return out


def root_paths(parents: Sequence[int]) -> list[list[int]]:
    """Each node's path from its root: its ancestors in depth order, then itself."""
    paths: list[list[int]] = []
    for i, p in enumerate(check_parents(parents)):
        paths.append((paths[p] if p >= 0 else []) + [i])
    return paths


def ancestor_matrix(parents: Sequence[int]) -> np.ndarray:
    """bool [n, n]: row i marks node i and its ancestors (the nodes it attends to)."""
    anc = np.eye(len(parents), dtype=bool)
    for i, p in enumerate(check_parents(parents)):
        if p >= 0:  # the parent's row is already complete
            anc[i] |= anc[p]
    return anc


def tree_positions(positions: Sequence[int], num_tokens: Sequence[int],
                   tree_parents: Sequence[Sequence[int] | None]) -> list[int]:
    """A step's token positions with every tree request's rows moved to prefix + depth.

    positions: [T] consecutive per request (prefix, prefix + 1, ...); num_tokens: [B] rows per
    request; tree_parents: [B], None for a request whose rows are causal. A tree covers all of
    its request's rows."""
    out, offset = list(positions), 0
    for n, parents in zip(num_tokens, tree_parents):
        if parents is not None:
            if len(parents) != n:
                raise ValueError(f"a tree of {len(parents)} nodes for a request with {n} rows")
            first = positions[offset]
            out[offset:offset + n] = (first + depths(parents)).tolist()
        offset += n
    return out


def num_words(width: int) -> int:
    """int32 words per packed row of `width` columns (at least one)."""
    return max(1, -(-int(width) // WORD_BITS))


def pack_bits(dense: np.ndarray, words: int | None = None) -> np.ndarray:
    """bool [n, m] -> int32 [n, W] (default W = num_words(m)); bit j % 32 of word j // 32."""
    n, m = dense.shape
    words = num_words(m) if words is None else words
    if words * WORD_BITS < m:
        raise ValueError(f"{words} words cannot hold {m} columns")
    padded = np.zeros((n, words * WORD_BITS), dtype=np.int64)
    padded[:, :m] = dense
    weights = np.int64(1) << np.arange(WORD_BITS, dtype=np.int64)
    unsigned = (padded.reshape(n, words, WORD_BITS) * weights).sum(-1)  # [n, W] in [0, 2^32)
    return unsigned.astype(np.uint32).view(np.int32)  # same bits, as the kernel's int32


def unpack_bits(packed: np.ndarray, width: int) -> np.ndarray:
    """int32 [n, W] -> bool [n, width] (the inverse of pack_bits)."""
    n, words = packed.shape
    bits = (packed.astype(np.int64)[:, :, None] >> np.arange(WORD_BITS)) & 1  # [n, W, 32]
    return bits.reshape(n, words * WORD_BITS)[:, :width].astype(bool)


def packed_step_mask(tree_parents: Sequence[Sequence[int] | None], query_lens: Sequence[int]) -> np.ndarray:
    """int32 [T, W] for a whole step: each request's rows packed with W words for the longest
    request; a request without a tree gets causal rows (what paged attention would do)."""
    words = num_words(max(query_lens))
    rows = [pack_bits(ancestor_matrix(chain_parents(n) if parents is None else parents), words)
            for parents, n in zip(tree_parents, query_lens)]
    return np.concatenate(rows)
