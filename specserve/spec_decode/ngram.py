"""Prompt lookup: copy what followed the context's suffix earlier on (docs/speculation.md).

For each request, the longest suffix of its committed tokens (prompt_lookup_max down to
prompt_lookup_min tokens) is looked up in the earlier prompt + output; the k tokens after its
most recent occurrence become a one-hot chain (continuing over the copy itself when the match
is recent, so a period-p loop still yields k tokens). Method "ngram" drafts with this alone;
the tree methods graft its chain onto every tree. Each request keeps an index of its own
n-grams (`NgramIndex`) that grows with its committed tokens: a lookup is at most
prompt_lookup_max dictionary reads whatever the context's length.
"""

from __future__ import annotations


class NgramIndex:
    """The n-grams (min_n <= n <= max_n) of one request's committed tokens."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.next_of: dict[tuple[int, ...], int] = {}  # n-gram -> position of the token after it
        self.size = 0  # tokens indexed

    def sync(self, tokens: list[int]) -> None:
        """Index the tokens appended since the last call (committed tokens only grow)."""
        if len(tokens) < self.size:  # never happens for committed tokens; rebuild to stay safe
            self.next_of.clear()
            self.size = 0
        next_of, lo, hi = self.next_of, self.min_n, self.max_n
        for p in range(max(1, self.size), len(tokens)):  # n-grams ending at p - 1, followed by token p
            for n in range(lo, min(hi, p) + 1):
                next_of[tuple(tokens[p - n:p])] = p
        self.size = len(tokens)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """k tokens after the most recent earlier occurrence of the longest matching suffix of
        tokens (which `sync` has indexed); [] when no suffix recurs."""
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self.next_of.get(tuple(tokens[length - n:]))
            if start is not None:
                out: list[int] = []
                for j in range(k):  # past the end, continue over the copy itself
                    p = start + j
                    out.append(tokens[p] if p < length else out[p - length])
                return out
        return []


class NgramProposer:
    """Prompt-lookup chains of at most k tokens per request."""

    def __init__(self, k: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k, self.min_n, self.max_n = k, prompt_lookup_min, prompt_lookup_max
        self._index: dict[str, NgramIndex] = {}

    def lookup(self, request_ids: list[str], token_ids: list[list[int]], ks: list[int],
               tenants: list[str | None] | None = None) -> list[list[int]]:
        """One chain (maybe empty) per request, of at most ks[i] tokens (from its own text:
        `tenants` do not matter here)."""
        out = []
        for rid, tokens, k in zip(request_ids, token_ids, ks):
            index = self._index.get(rid)
            if index is None:
                index = self._index[rid] = NgramIndex(self.min_n, self.max_n)
            index.sync(tokens)
            out.append(index.lookup(tokens, k) if k > 0 else [])
        return out

    def free(self, request_id: str) -> None:
        self._index.pop(request_id, None)
