"""DraftTree, the one record every proposer returns, and the Proposer protocol.

A draft is a tree of candidate tokens that hangs off a request's last committed token. Nodes
are listed parents first; `parents[i]` is the index of node i's parent, or -1 for a node that
directly follows the committed tokens. A chain (n-gram, draft model) is the tree whose node i
has parent i - 1. Tree methods (EAGLE, Medusa) will return wider trees through the same
record; the verifier in specserve.spec_decode.step accepts chains only for now.

`probs` holds the distribution each node was drawn from (the draft's processed distribution,
q in the Leviathan/Chen rule) when the method has one; None means every node is one-hot (an
n-gram lookup, or a greedy draft model), which is what the rejection sampler assumes then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.request import Request


@dataclass
class DraftTree:
    tokens: list[int]  # [n] draft token ids, parents before children
    parents: list[int]  # [n] parent node index, -1 for children of the last committed token
    probs: torch.Tensor | None = None  # [n, V] float draft distribution per node, None = one-hot

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.parents)
        assert all(-1 <= p < i for i, p in enumerate(self.parents)), "parents precede children"
        assert self.probs is None or self.probs.shape[0] == len(self.tokens)

    @staticmethod
    def chain(tokens: Sequence[int], probs: torch.Tensor | None = None) -> "DraftTree":
        return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)), probs)

    def graft(self, chain: Sequence[int], limit: int) -> tuple["DraftTree", list[int]]:
        """This tree with `chain` (tokens that would follow the committed ones) merged in as a
        path from the root: it follows existing nodes while they match and appends the rest
        after every existing node, so parents still precede children. At most `limit` nodes
        in all (the tree's own nodes first). Returns the tree and the chain's node indices in
        it (a prefix of the chain where the limit cut it). One-hot only: needs probs None."""
        assert self.probs is None, "graft: trees with draft probabilities cannot take foreign nodes"
        tokens, parents = list(self.tokens[:limit]), list(self.parents[:limit])
        path = path_of(tokens, parents, chain)  # the chain's prefix already in the tree
        at = path[-1] if path else -1
        for tok in list(chain)[len(path):len(path) + limit - len(tokens)]:
            tokens.append(tok)
            parents.append(at)
            at = len(tokens) - 1
            path.append(at)
        return DraftTree(tokens, parents), path

    @property
    def depth(self) -> list[int]:
        """Depth of each node: 1 for a child of the committed tokens."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    def __len__(self) -> int:
        return len(self.tokens)


class Proposer(Protocol):
    """Drafts the next tokens of running requests; called once per engine step.

    `propose` gets the requests that may speculate this step (each has one pending
    committed token: the KV of every earlier token is computed) and for each the largest
    number of draft tokens it may return. It returns one DraftTree per request, or None for
    no draft. A proposer may keep per-request state (an index, a KV cache) but must treat
    all of it as a cache: committed tokens (`req.all_token_ids`) are the only truth, and
    drafts from earlier steps may have been rejected, or the request preempted, since.
    """

    name: str

    def propose(self, requests: list[Request], max_drafts: list[int]) -> list[DraftTree | None]:
        ...


def path_of(tokens: Sequence[int], parents: Sequence[int], chain: Sequence[int]) -> list[int]:
    """Node indices of the longest prefix of `chain` that is a path from the root of the tree
    (tokens, parents)."""
    kids = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents))}
    path, at = [], -1
    for tok in chain:
        at = kids.get((at, tok), -2)
        if at < 0:
            break
        path.append(at)
    return path
