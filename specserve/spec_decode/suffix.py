"""Suffix decoding: draft trees from what followed the context's suffix before, in this request
and in earlier requests of the same tenant, scored by how often each continuation followed
(method "suffix"; docs/speculation.md).

No model runs: a draft costs a few vector passes and dictionary reads. For each request the
longest suffix of its committed tokens (max_match down to min_match tokens) is searched for in
its own prompt and output (`SuffixIndex`: an array, compared in a few vector passes) and
looked up among the n-grams of the outputs of recent finished requests of the same tenant
(`SuffixCorpus`, bounded, oldest out). The continuations of the most recent occurrences of the
longest suffix found are merged into a trie; a node's count is how many occurrences continue
through it, its score the log of the share of occurrences that do (its path's frequency). The
best-scored nodes form the tree, at most max_drafts and SPEC_PER_MATCHED per matched token (a
one-token match is weak evidence, a twelve-token one strong). The decoder values the tree's
first path (the most frequent continuation) like a prompt-lookup chain, by the request's own
acceptance by depth, and the other branches by their scores as the policy's calibration
learned them; the cost model keeps the nodes that pay their rows. Trees are one-hot, so
verification is exact for greedy and sampled requests alike.

Tenants: a request drafts only from its own text and from the outputs of requests of the same
tenant (the API key it came with), so nothing one tenant wrote can be drafted for another, nor
be probed through acceptance timing. `shared_corpus: true` makes all tenants one.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque

import numpy as np

from specserve.spec_decode.draft_tree import DraftTree, ProposeBatch

MAX_OCCURRENCES = 16  # most recent occurrences of an n-gram whose continuations are merged
SPEC_PER_MATCHED = 2.0  # nodes drafted per token of the matched suffix (at least 2, at most k)
DEFAULT_CORPUS_TOKENS = 1 << 16  # per tenant: output tokens of finished requests kept


def _key(tokens: list[int], end: int, n: int) -> int:
    """The n-gram tokens[end - n:end] as a dictionary key (a collision only costs a draft that
    verification rejects)."""
    return hash(tuple(tokens[end - n:end]))


class SuffixIndex:
    """One request's committed tokens, searched for a suffix's earlier occurrences by comparing
    arrays: nothing to build per token (a dictionary of every n-gram cost 9 ms per 1,000 tokens
    of prompt, on the engine's thread), a search a few vector passes over the context."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        # the tokens from offset max_n on, after max_n of -1 that match no token: a comparison
        # reaching back past the first token needs no bounds check
        self.buf = np.full(max_n + 256, -1, dtype=np.int64)
        self.size = 0  # tokens held

    def sync(self, tokens: list[int]) -> None:
        """Take the tokens appended since the last call (committed tokens only grow)."""
        if len(tokens) < self.size:  # never for committed tokens; start again to stay safe
            self.size = 0
        pad = self.max_n
        if pad + len(tokens) > len(self.buf):
            grown = np.full(pad + max(len(tokens), 2 * (len(self.buf) - pad)), -1, dtype=np.int64)
            grown[:pad + self.size] = self.buf[:pad + self.size]
            self.buf = grown
        if len(tokens) > self.size:
            self.buf[pad + self.size:pad + len(tokens)] = tokens[self.size:]
            self.size = len(tokens)

    def matches(self, tokens: list[int]) -> tuple[int, np.ndarray]:
        """(m, positions): the longest suffix of `tokens` (at most max_n tokens) that occurred
        earlier in the held tokens, and the positions of the tokens that followed its
        occurrences, most recent first; (0, []) when not even its last token did."""
        held = min(self.size, len(tokens))
        cap = min(self.max_n, len(tokens) - 1)
        if cap < 1 or held < 2:
            return 0, _NONE
        pad, buf = self.max_n, self.buf
        # p: the positions after an occurrence of the last token (p - 1 < held - 1)
        after = np.flatnonzero(buf[pad:pad + held - 1] == tokens[-1]) + 1
        if not len(after):
            return 0, _NONE
        back = (after + (pad - 1))[:, None] - np.arange(cap)  # [occurrence, i]: the token i before
        same = buf[back] == np.array(tokens[-1:-cap - 1:-1], dtype=np.int64)
        length = np.cumprod(same, axis=1).sum(axis=1)
        m = int(length.max())
        return m, after[length >= m][::-1]


_NONE = np.zeros(0, dtype=np.int64)


class SuffixCorpus:
    """The outputs of one tenant's finished requests, at most `max_tokens` in all (oldest out),
    and where each of their n-grams occurs (most recent MAX_OCCURRENCES)."""

    def __init__(self, min_n: int, max_n: int, max_tokens: int) -> None:
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        self.docs: OrderedDict[int, list[int]] = OrderedDict()
        self.after: dict[int, deque[tuple[int, int]]] = {}  # n-gram -> (doc, position after it)
        self.num_tokens = 0
        self._next_doc = 0

    def add(self, tokens: list[int]) -> None:
        if len(tokens) <= self.min_n or len(tokens) > self.max_tokens:
            return
        doc, self._next_doc = self._next_doc, self._next_doc + 1
        self.docs[doc] = tokens = list(tokens)
        self.num_tokens += len(tokens)
        for p, n in self._grams(tokens):
            at = self.after.get(k := _key(tokens, p, n))
            if at is None:
                self.after[k] = deque([(doc, p)], MAX_OCCURRENCES)
            else:
                at.append((doc, p))
        while self.num_tokens > self.max_tokens:
            self._evict()

    def _grams(self, tokens: list[int]):
        for p in range(1, len(tokens)):
            for n in range(self.min_n, min(self.max_n, p) + 1):
                yield p, n

    def _evict(self) -> None:
        doc, tokens = self.docs.popitem(last=False)
        self.num_tokens -= len(tokens)
        for p, n in self._grams(tokens):
            k = _key(tokens, p, n)
            at = self.after.get(k)
            if at is not None:
                try:
                    at.remove((doc, p))
                except ValueError:  # pushed out by newer occurrences already
                    pass
                if not at:
                    del self.after[k]

    def occurrences(self, key: int) -> list[tuple[list[int], int]]:
        return [(self.docs[d], p) for d, p in self.after.get(key, ())]


class SuffixProposer:
    """Method "suffix": trees from the request's own text and its tenant's recent outputs."""

    name = "suffix"
    needs_hidden = False
    costs_per_request = False  # no model: drafts for every request, every step

    def __init__(self, max_drafts: int, min_match: int = 1, max_match: int = 12,
                 corpus_tokens: int = DEFAULT_CORPUS_TOKENS, shared_corpus: bool = False) -> None:
        self.max_drafts, self.min_n, self.max_n = max_drafts, min_match, max_match
        self.corpus_tokens, self.shared = corpus_tokens, shared_corpus
        self._index: dict[str, SuffixIndex] = {}
        self._corpora: dict[str | None, SuffixCorpus] = {}

    def corpus(self, tenant: str | None) -> SuffixCorpus:
        key = None if self.shared else tenant
        found = self._corpora.get(key)
        if found is None:
            found = self._corpora[key] = SuffixCorpus(self.min_n, self.max_n, self.corpus_tokens)
        return found

    def observe(self, request_ids, starts, sizes, hidden) -> None:
        """Never called (needs_hidden is False): suffix decoding reads tokens only."""

    def _indexed(self, request_id: str, tokens: list[int]) -> SuffixIndex:
        index = self._index.get(request_id)
        if index is None:
            index = self._index[request_id] = SuffixIndex(self.min_n, self.max_n)
        index.sync(tokens)
        return index

    def propose(self, batch: ProposeBatch) -> list[DraftTree | None]:
        tenants = batch.tenants or [None] * len(batch.request_ids)
        return [self.draft(tokens, self._indexed(rid, tokens), self.corpus(tenant),
                           min(k, self.max_drafts), batch.min_score)
                for rid, tokens, k, tenant in zip(batch.request_ids, batch.token_ids,
                                                  batch.max_drafts, tenants)]

    @property
    def k(self) -> int:
        return self.max_drafts

    def lookup(self, request_ids: list[str], token_ids: list[list[int]], ks: list[int],
               tenants: list[str | None] | None = None) -> list[list[int]]:
        """As a tree method's lookup branch (in place of prompt lookup): the first path of each
        request's suffix tree, at most ks[i] tokens."""
        out = []
        for rid, tokens, k, tenant in zip(request_ids, token_ids, ks, tenants or [None] * len(ks)):
            tree = self.draft(tokens, self._indexed(rid, tokens), self.corpus(tenant), k) if k > 0 else None
            out.append([tree.tokens[i] for i in tree.first_path()] if tree is not None else [])
        return out

    def draft(self, tokens: list[int], index: SuffixIndex, corpus: SuffixCorpus, k: int,
              min_score: float = -math.inf) -> DraftTree | None:
        """The tree of at most k nodes for the context `tokens` (indexed in `index`)."""
        if k <= 0:
            return None
        sources, matched = self._match(tokens, index, corpus)
        if not sources:
            return None
        k = min(k, max(2, round(SPEC_PER_MATCHED * matched)))  # longer matches: longer drafts
        # the trie of continuations: node -> [count, token, parent, children {token: node}]
        count, token, parent, kids = [len(sources)], [-1], [-1], [{}]
        for seq, p in sources:
            at = 0
            # past the end of the request's own text the match continues over its copy (a
            # loop of period len - p yields k tokens); another request's output just ends
            period = len(seq) - p if seq is tokens else k
            for j in range(k if seq is tokens else min(k, len(seq) - p)):
                t = seq[p + j % period]
                child = kids[at].get(t)
                if child is None:
                    child = kids[at][t] = len(count)
                    count.append(0)
                    token.append(t)
                    parent.append(at)
                    kids.append({})
                count[child] += 1
                at = child
        # a node's score: the log of the share of occurrences that continue through it (its
        # path's frequency); best first, a parent before its child on a tie (nodes are numbered
        # parents first), so the chosen nodes form a tree
        score = [math.log(c / count[0]) for c in count]
        chosen = [n for n in heapq.nlargest(k, range(1, len(count)), key=lambda n: (score[n], -n))
                  if score[n] >= min_score]
        if not chosen:
            return None
        keep = set(chosen)
        order, stack = [], sorted((c for c in kids[0].values() if c in keep), key=lambda c: -count[c])[::-1]
        while stack:  # depth first, the most frequent child first
            node = stack.pop()
            order.append(node)
            stack += sorted((c for c in kids[node].values() if c in keep), key=lambda c: -count[c])[::-1]
        slot = {node: i for i, node in enumerate(order)}
        return DraftTree([token[n] for n in order], [slot.get(parent[n], -1) for n in order],
                         None, [score[n] for n in order], True)

    def _match(self, tokens: list[int], index: SuffixIndex, corpus: SuffixCorpus
               ) -> tuple[list[tuple[list[int], int]], int]:
        """(sequence, position) of the continuations of the longest suffix of `tokens` found in
        the request's own text or its tenant's corpus, most recent first; and its length."""
        own, positions = index.matches(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            found = corpus.occurrences(_key(tokens, len(tokens), n))[::-1] if corpus.after else []
            if n <= own:
                found = [(tokens, p) for p in positions[:MAX_OCCURRENCES].tolist()] + found
            if found:
                return found[:2 * MAX_OCCURRENCES], n
        return [], 0

    def remember(self, request_id: str, output: list[int], tenant: str | None) -> None:
        """A request finished: its output joins its tenant's corpus."""
        self.corpus(tenant).add(output)

    def free(self, request_id: str) -> None:
        self._index.pop(request_id, None)
