"""Suffix decoding: draft trees from what followed the context's suffix before, in this request
and in earlier requests of the same tenant, scored by how often each continuation followed
(method "suffix"; docs/speculation.md).

No model runs: a draft costs a few vector passes. For each request the longest suffix of its
committed tokens (max_match down to min_match tokens) is searched for in its own prompt and
output (`SuffixIndex`) and in the outputs of recent finished requests of the same tenant
(`SuffixCorpus`, bounded, oldest out): both are arrays of tokens, searched the same way
(`_longest_suffix`), with nothing built per token. The continuations of the most recent
occurrences of the longest suffix found are merged into a trie; a node's count is how many
occurrences continue through it, its score the log of the share of occurrences that do (its
path's frequency). The best-scored nodes form the tree, at most max_drafts and
SPEC_PER_MATCHED per matched token (a one-token match is weak evidence, a twelve-token one
strong). The decoder values the tree's first path (the most frequent continuation) like a
prompt-lookup chain, by the request's own acceptance by depth, and the other branches by their
scores as the policy's calibration learned them; the cost model keeps the nodes that pay their
rows. Trees are one-hot, so verification is exact for greedy and sampled requests alike.

Tenants: a request drafts only from its own text and from the outputs of requests of the same
tenant (the API key it came with), so nothing one tenant wrote can be drafted for another, nor
be probed through acceptance timing. `shared_corpus: true` makes all tenants one.
"""

from __future__ import annotations

import bisect
import heapq
import math

import numpy as np

from specserve.spec_decode.draft_tree import DraftTree, ProposeBatch

MAX_OCCURRENCES = 16  # most recent occurrences of an n-gram whose continuations are merged
SPEC_PER_MATCHED = 2.0  # nodes drafted per token of the matched suffix (at least 2, at most k)
DEFAULT_CORPUS_TOKENS = 1 << 16  # per tenant: output tokens of finished requests kept


def _longest_suffix(buf: np.ndarray, pad: int, held: int, tokens: list[int], cap: int,
                    bounded: bool = False) -> tuple[int, np.ndarray]:
    """(m, positions): the longest suffix of `tokens` (at most cap tokens) that occurs in
    buf[pad:pad + held], and the positions (relative to pad) of the tokens that followed its
    occurrences, most recent first; (0, []) when not even its last token occurs. buf holds -1
    (no token) in the pad before; with `bounded`, -1 also ends each document, and an occurrence
    at a document's end (nothing after it) does not count. One comparison of the whole stretch,
    then of the survivors only, a token further back at a time."""
    after = np.flatnonzero(buf[pad:pad + held] == buf.dtype.type(tokens[-1])) + 1
    if bounded and len(after):
        after = after[buf[after + pad] >= 0]
    if not len(after):
        return 0, _NONE
    m = 1
    while m < cap and len(after) > _FEW:
        same = buf[after + (pad - 1 - m)] == tokens[-1 - m]
        if not same.any():
            return m, after[::-1]
        after = after[same]
        m += 1
    if m < cap:  # a few left: each one's match compared as a list
        want = tokens[-cap:-m]
        lengths = []
        for q in after.tolist():
            seen = buf[pad + q - cap:pad + q - m].tolist()
            n = 0
            while n < len(want) and seen[-1 - n] == want[-1 - n]:
                n += 1
            lengths.append(n)
        top = max(lengths)
        after = after[np.asarray(lengths) == top]
        m += top
    return m, after[::-1]


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
        return _longest_suffix(self.buf, self.max_n, held - 1, tokens, cap)


_NONE = np.zeros(0, dtype=np.int64)
_FEW = 8  # at most this many occurrences left: _longest_suffix compares each one's match as a list


class SuffixCorpus:
    """The outputs of one tenant's finished requests, at most `max_tokens` in all (oldest out),
    one after another in one array (each ended by -1), searched like a request's own text.

    Adding an output is one copy into the array and evicting the oldest one shift; nothing is
    built per token, so a finishing request never stalls the engine's step, and the corpus
    takes 4 bytes a token (a dictionary of every n-gram took ~0.7 GB for a full corpus and
    0.4-1.2 s of the engine's step to take a long output in; docs/benchmarks.md)."""

    def __init__(self, min_n: int, max_n: int, max_tokens: int) -> None:
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        self.docs: list[list[int]] = []  # oldest first
        self.starts: list[int] = []  # where each doc begins, counted since the first doc ever
        self.base = 0  # ... where the array's first entry after the pad is
        self.num_tokens = 0
        self.buf = np.full(max_n, -1, dtype=np.int32)  # max_n of -1, then the docs
        self.size = 0  # array entries held after the pad: tokens and the -1 ending each doc

    def add(self, tokens: list[int]) -> None:
        if len(tokens) <= self.min_n or len(tokens) > self.max_tokens:
            return
        pad, need = self.max_n, self.size + len(tokens) + 1
        if pad + need > len(self.buf):
            grown = np.full(pad + max(need, 2 * (len(self.buf) - pad)), -1, dtype=np.int32)
            grown[:pad + self.size] = self.buf[:pad + self.size]
            self.buf = grown
        self.buf[pad + self.size:pad + need - 1] = tokens
        self.buf[pad + need - 1] = -1
        self.docs.append(list(tokens))
        self.starts.append(self.base + self.size)
        self.size = need
        self.num_tokens += len(tokens)
        if self.num_tokens > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        """Drop the oldest docs until the rest fit: one shift of the array."""
        drop, kept = 0, self.num_tokens
        while kept > self.max_tokens:
            kept -= len(self.docs[drop])
            drop += 1
        del self.docs[:drop], self.starts[:drop]
        self.num_tokens = kept
        cut = self.starts[0] - self.base if self.starts else self.size
        pad = self.max_n
        self.buf[pad:pad + self.size - cut] = self.buf[pad + cut:pad + self.size]
        self.buf[pad + self.size - cut:pad + self.size] = -1
        self.size -= cut
        self.base += cut

    def matches(self, tokens: list[int], cap: int) -> tuple[int, list[tuple[list[int], int]]]:
        """(m, occurrences): the longest suffix of `tokens` (at most cap tokens) found in the
        corpus, and (doc, position of what followed) of its most recent MAX_OCCURRENCES
        occurrences, most recent first."""
        if not self.size or cap < 1:
            return 0, []
        m, after = _longest_suffix(self.buf, self.max_n, self.size, tokens, cap, bounded=True)
        starts, docs, out = self.starts, self.docs, []
        for q in after[:MAX_OCCURRENCES].tolist():
            d = bisect.bisect_right(starts, q + self.base) - 1
            out.append((docs[d], q + self.base - starts[d]))
        return m, out


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
        theirs, occurrences = corpus.matches(tokens, min(self.max_n, len(tokens) - 1))
        m = max(own, theirs)
        if m < self.min_n:
            return [], 0
        found = [(tokens, p) for p in positions[:MAX_OCCURRENCES].tolist()] if own == m else []
        return found + (occurrences if theirs == m else []), m

    def remember(self, request_id: str, output: list[int], tenant: str | None) -> None:
        """A request finished: its output joins its tenant's corpus."""
        self.corpus(tenant).add(output)

    def free(self, request_id: str) -> None:
        self._index.pop(request_id, None)
