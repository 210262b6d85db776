"""DraftTree, the one record every proposer returns, and the Proposer protocol with its inputs.

A draft is a tree of candidate tokens hanging off a request's last committed token (the
root). Nodes come parents first; `parents[i]` is node i's parent, -1 for a child of the root;
siblings are distinct; a chain (n-gram, draft model) is the tree whose node i has parent i - 1.
`probs`: the distribution each node was drawn from (q of the rejection rule) when the method
samples its drafts (chains only); None means one-hot nodes, exact for sampled requests too.
`scores`: the log draft probability of each node's path (None: no score; the cost model then
uses measured acceptance by depth). `dfs`: the nodes are in depth-first order, a node's first
child first (see `preorder`), the order verification wants: the decoder then keeps it as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.request import SamplingParams


@dataclass
class DraftTree:
    tokens: list[int]  # [n] draft token ids, parents before children
    parents: list[int]  # [n] parent node index, -1 for children of the root
    probs: torch.Tensor | None = None  # [n, V] draft distribution per node (chains only), None = one-hot
    scores: list[float | None] | None = None  # [n] log P_draft(path to the node), None = no score
    dfs: bool = False  # nodes in depth-first order

    @staticmethod
    def chain(tokens: Sequence[int], probs: torch.Tensor | None = None,
              scores: list[float] | None = None) -> "DraftTree":
        return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)), probs, scores, True)

    def graft(self, chain: Sequence[int]) -> tuple["DraftTree", list[int]]:
        """This tree with `chain` (tokens that would follow the committed ones) merged in as a
        path from the root: it follows existing nodes while they match and appends the rest.
        Returns the tree and the chain's node indices in it. One-hot trees only. New nodes go
        last: the tree stays depth-first when they hang off its last path."""
        assert self.probs is None, "graft: trees with draft probabilities cannot take foreign nodes"
        if not self.tokens:  # (a lookup chain alone, as in every step without the proposer's drafts)
            return DraftTree.chain(chain, scores=[None] * len(chain)), list(range(len(chain)))
        tokens, parents = list(self.tokens), list(self.parents)
        scores = list(self.scores) if self.scores is not None else [None] * len(tokens)
        kids = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents))}
        path, at, dfs = [], -1, self.dfs or not tokens
        for tok in chain:  # along existing nodes while they match, then new ones
            node = kids.get((at, tok))
            if node is None:
                if len(tokens) == len(self.tokens) and dfs:  # the first new node: is `at` on the last path?
                    last = len(tokens) - 1
                    while last > at:
                        last = parents[last]
                    dfs = last == at
                node = len(tokens)
                tokens.append(tok)
                parents.append(at)
                scores.append(None)
            path.append(node)
            at = node
        return DraftTree(tokens, parents, None, scores, dfs), path

    def select(self, keep: Sequence[int], dfs: bool = False) -> "DraftTree":
        """The nodes `keep` (each one's parent kept before it), in that order, re-indexed;
        `dfs`: the caller knows that order to be depth-first."""
        index = {old: new for new, old in enumerate(keep)}
        parents = [index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep]
        probs = self.probs[list(keep)] if self.probs is not None else None
        scores = [self.scores[i] for i in keep] if self.scores is not None else None
        return DraftTree([self.tokens[i] for i in keep], parents, probs, scores, dfs)

    def prefix(self, k: int) -> "DraftTree":
        """The first k nodes (a tree, since parents come first), indices unchanged."""
        if k == len(self.tokens):
            return self
        return DraftTree(self.tokens[:k], self.parents[:k], self.probs[:k] if self.probs is not None else None,
                         self.scores[:k] if self.scores is not None else None, self.dfs)

    @property
    def depth(self) -> list[int]:
        """Depth of each node: 1 for a child of the root."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def first_path(self) -> list[int]:
        """The nodes 0, 1, ... each the child of the one before: the first path of a depth-first
        tree (its first-choice continuation)."""
        n = 0
        while n < len(self.parents) and self.parents[n] == n - 1:
            n += 1
        return list(range(n))

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    def __len__(self) -> int:
        return len(self.tokens)


def preorder(parents: Sequence[int], nodes: Sequence[int]) -> list[int]:
    """`nodes` (a tree: each one's parent among them, or -1) depth first, siblings in their
    order in `nodes`. A verified tree's accepted path has to sit right after its root in the KV
    cache; listing the first-choice path first means that when it is the one accepted (the
    likeliest outcome) its KV is already in place and nothing moves."""
    kids: dict[int, list[int]] = {}
    for i in nodes:
        kids.setdefault(parents[i], []).append(i)
    if len(kids) == len(nodes):  # one child each: a chain, already in order
        return list(nodes)
    out, stack = [], kids.get(-1, [])[::-1]
    while stack:
        i = stack.pop()
        out.append(i)
        stack += kids.get(i, [])[::-1]
    return out


@dataclass
class ProposeBatch:
    """What a proposer gets for the requests that draft this step. Each request has exactly one
    pending committed token (the KV of every earlier token is computed)."""

    request_ids: list[str]
    token_ids: list[list[int]]  # committed tokens of each request (read only)
    max_drafts: list[int]  # the most nodes each tree may have
    min_score: float  # cost model: nodes whose score is below this do not pay their row
    params: list[SamplingParams]  # each request's sampling parameters (a draft model samples with them)
    seeds: list[int]  # each request's sampling seed
    block_ids: list[list[int]]  # block tables (a draft model's own KV uses the target's tables)
    num_computed: list[int]  # positions whose target KV is computed (the rest may be stale)
    tenants: list[str | None] | None = None  # whose text each request may draft from (suffix)


class Proposer(Protocol):
    """Drafts the next tokens of running requests; owns only caches of what it was shown.

    * `observe(request_ids, starts, sizes, hidden)`: the target's final hidden states of newly
      computed committed tokens, request after request in the rows of hidden: positions
      starts[i] .. starts[i] + sizes[i] - 1 of request i (anything the proposer holds at or past
      starts[i] is stale). Called only when `needs_hidden`.
    * `propose(batch)`: one DraftTree (or None: no draft) per request of the batch, at most
      batch.max_drafts[i] nodes each.
    * `free(request_id)`: forget the request (finished, aborted or preempted).
    `feature_steps` (with `needs_hidden`): decode steps of features it needs to draft again as
    it would have with all of them (EAGLE: what its catch-up reads; Medusa: the last one); a
    request it will not draft for within that many steps (its steps measured slower at the
    batch size, or the request's own gate off, the next probe further off) is shown none of its
    decode rows' features.
    `costs_per_request` False (suffix decoding: dictionary reads, no model) drafts for every
    request every step, its first paths valued like prompt-lookup chains.
    Committed tokens are the only truth: drafts from earlier steps may have been rejected, or a
    request preempted, since anything was cached.
    """

    name: str
    needs_hidden: bool
    costs_per_request: bool  # drafting runs a model: the policy gates it per request

    def observe(self, request_ids: list[str], starts: list[int], sizes: list[int], hidden: torch.Tensor) -> None:
        ...

    def propose(self, batch: ProposeBatch) -> list[DraftTree | None]:
        ...

    def free(self, request_id: str) -> None:
        ...
