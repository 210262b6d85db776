"""Prompt lookup: copy what followed the context's suffix earlier on.

For each request, the longest suffix of its committed tokens (prompt_lookup_max down to
prompt_lookup_min tokens) is looked up in the earlier prompt + output; the k tokens after its
most recent occurrence become a one-hot chain (continuing over the copy itself when the match
is recent, so a period-p loop still yields k tokens). Method "ngram" drafts with this alone;
the tree methods graft its chain onto every tree. Each request keeps a growing numpy copy of
its tokens; a lookup is a few vectorised comparisons (tens of microseconds at 4k tokens).
"""

from __future__ import annotations

import numpy as np


class _TokenBuffer:
    """Committed tokens of one request as a numpy array with amortised appends."""

    def __init__(self) -> None:
        self.data = np.zeros(256, dtype=np.int64)
        self.size = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        n = len(tokens)
        if n < self.size:  # never happens for committed tokens; rebuild to stay safe
            self.size = 0
        if n > self.data.size:
            grown = np.zeros(max(n, 2 * self.data.size), dtype=np.int64)
            grown[:self.size] = self.data[:self.size]
            self.data = grown
        if n > self.size:
            self.data[self.size:n] = tokens[self.size:n]
            self.size = n
        return self.data[:n]


def ngram_lookup(ctx: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Draft k tokens by prompt lookup in ctx (int array); [] when no suffix recurs."""
    length = len(ctx)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # candidate starts i in [0, length - n): window ctx[i:i+n] vs the suffix ctx[-n:]
        hits = ctx[:length - n] == ctx[length - n]
        for j in range(1, n):
            hits &= ctx[j:length - n + j] == ctx[length - n + j]
        found = np.flatnonzero(hits)
        if found.size:
            start = int(found[-1]) + n  # first token after the most recent match
            out: list[int] = []
            for j in range(k):  # past the end, continue over the copy itself
                p = start + j
                out.append(int(ctx[p]) if p < length else out[p - length])
            return out
    return []


class NgramProposer:
    """Prompt-lookup chains of at most k tokens per request."""

    def __init__(self, k: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k, self.min_n, self.max_n = k, prompt_lookup_min, prompt_lookup_max
        self._buffers: dict[str, _TokenBuffer] = {}

    def lookup(self, request_ids: list[str], token_ids: list[list[int]], ks: list[int]) -> list[list[int]]:
        """One chain (maybe empty) per request, of at most ks[i] tokens."""
        out = []
        for rid, tokens, k in zip(request_ids, token_ids, ks):
            buf = self._buffers.get(rid)
            if buf is None:
                buf = self._buffers[rid] = _TokenBuffer()
            out.append(ngram_lookup(buf.sync(tokens), self.min_n, self.max_n, k) if k > 0 else [])
        return out

    def free(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)
