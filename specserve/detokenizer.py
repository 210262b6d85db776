"""Incremental detokenisation with stop strings.

`visible_text` only ever grows while a request runs, so a streaming frontend can send its
new suffix as a delta. It holds back (a) an incomplete UTF-8 sequence at the end (the
tokenizer decodes it as U+FFFD until its last byte arrives) and (b) a tail that could still
become a stop string. When a stop string completes, the text is cut right before it
(or after it with include_stop_str_in_output) and the request finishes at that token.

Stop strings are matched by a `StopMatcher`, an Aho-Corasick automaton built once per tuple
of stop strings and shared by every request that uses it (`stop_matcher`). A request keeps
only the automaton's state after its text so far; each new character is fed once, so the
work per step is proportional to the characters the step adds, whatever the length of the
text or the number and length of the stop strings.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

_CONTEXT_TOKENS = 6  # prompt tokens decoded ahead of the output so leading spaces come out right


class StopMatcher:
    """Aho-Corasick automaton over a tuple of non-empty stop strings.

    States are integers, the nodes of the trie of the stop strings; 0 is the root (nothing
    matched). The state after a text is the node of the longest suffix of the text that is a
    prefix of a stop string. A matcher is immutable once built and holds no per-request data,
    so one instance serves any number of requests on any number of threads.

    Building takes time and memory linear in the total length of the stop strings (about 20
    bytes a node: nodes are numbered in insertion order, so a chain of one-child nodes, most
    of a long stop string, needs no map). Each character fed goes at most one node deeper and
    each failure link followed goes at least one node up, so a text fed from state 0, in any
    number of pieces, follows no more failure links than it has characters, and one piece
    follows at most its length plus the longest stop string's.
    """

    __slots__ = ("stop", "num_chars", "num_states", "_label", "_parent", "_branch",
                 "_fail", "_held", "_match", "_lens")

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop: stop strings must be non-empty strings")
        self.num_chars = sum(len(s) for s in self.stop)
        self._lens = tuple(len(s) for s in self.stop)

        # The trie. Node v hangs below parent[v] by the character label[v]. The child created
        # right after its parent (node parent + 1) is found through label and parent; any other
        # child is in branch[parent].
        label: list[str] = [""]
        parent = [-1]
        depth = [0]
        ends = [-1]  # the first stop string (in `stop` order) that ends exactly at the node
        branch: dict[int, dict[str, int]] = {}
        for index, s in enumerate(self.stop):
            node = 0
            for ch in s:
                child = node + 1
                if not (child < len(label) and parent[child] == node and label[child] == ch):
                    children = branch.get(node)
                    child = children.get(ch) if children is not None else None
                    if child is None:
                        child = len(label)
                        if child != node + 1:
                            branch.setdefault(node, {})[ch] = child
                        label.append(ch)
                        parent.append(node)
                        depth.append(depth[node] + 1)
                        ends.append(-1)
                node = child
            if ends[node] < 0:
                ends[node] = index
        n = len(label)
        self.num_states = n
        # indexed by node: the root and an extra node n, which end the chain look-up from node
        # n - 1, are nobody's children (parent -1), so their labels are never compared
        self._label = " " + "".join(label[1:]) + " "
        self._parent = array("i", parent + [-1])
        self._branch = branch

        # Breadth first, so that a node's failure link (a shallower node) is known before the
        # node's children need it. Following failure links while building a stop string's path
        # costs at most its length, as while feeding it.
        fail = [0] * n  # node of the longest proper suffix of the node's string that is a node
        match = [-1] * n  # the stop string of the longest suffix that is a whole stop string
        held = [0] * n  # length of the longest suffix that is a proper prefix of a stop string
        label_of, parent_of = self._label, self._parent
        none: dict[str, int] = {}
        level = [0]
        while level:
            deeper = []
            for node in level:
                if parent_of[node + 1] == node:
                    deeper.append(node + 1)
                if node in branch:
                    deeper += branch[node].values()
            for child in deeper:
                node = parent_of[child]
                if node:
                    f, ch = fail[node], label_of[child]
                    while True:
                        if parent_of[f + 1] == f and label_of[f + 1] == ch:
                            fail[child] = f + 1
                            break
                        nxt = branch.get(f, none).get(ch)
                        if nxt is not None:
                            fail[child] = nxt
                            break
                        if not f:
                            break
                        f = fail[f]
                link = fail[child]
                match[child] = ends[child] if ends[child] >= 0 else match[link]
                held[child] = depth[child] if parent_of[child + 1] == child or child in branch else held[link]
            level = deeper
        self._fail = array("i", fail)
        self._match = array("i", match)
        self._held = array("i", held)

    def held(self, state: int) -> int:
        """Length of the longest tail of the text fed so far that is a proper prefix of a stop
        string (the part that could still become one)."""
        return self._held[state]

    def feed(self, state: int, text: str) -> tuple[int, int, int]:
        """Feed `text` from `state`. Returns (the state after it, and of the stop strings that
        end inside `text` the one that starts earliest, ties going to the first in `stop`
        order: its index in `stop` and where it starts relative to `text`, which is negative
        for one that began before `text`). The index is -1 if none ends inside `text`."""
        label, parent, branch = self._label, self._parent, self._branch
        fail, match, lens = self._fail, self._match, self._lens
        best = -1
        best_start = 0
        for i, ch in enumerate(text):
            while True:
                nxt = state + 1
                if label[nxt] == ch and parent[nxt] == state:
                    state = nxt
                    break
                children = branch.get(state)
                if children is not None:
                    nxt = children.get(ch)
                    if nxt is not None:
                        state = nxt
                        break
                if not state:
                    break
                state = fail[state]
            k = match[state]
            if k >= 0:
                start = i + 1 - lens[k]
                if best < 0 or start < best_start or (start == best_start and k < best):
                    best, best_start = k, start
        return state, best, best_start


_CACHE_MAX_ENTRIES = 128
_CACHE_MAX_CHARS = 1 << 20  # stop-string characters kept in all: 16 lists of 64 x 1024
_cache: OrderedDict[tuple[str, ...], StopMatcher] = OrderedDict()
_cache_chars = 0
_cache_lock = threading.Lock()


def stop_matcher(stop: Sequence[str]) -> StopMatcher:
    """The shared automaton of a list of stop strings (least recently used ones are dropped
    beyond 128 lists or 2**20 characters). Safe to call from any thread; a frontend may call
    it ahead of submitting a request so the engine thread finds it built."""
    global _cache_chars
    key = tuple(stop)
    with _cache_lock:
        matcher = _cache.get(key)
        if matcher is not None:
            _cache.move_to_end(key)
            return matcher
    built = StopMatcher(key)  # outside the lock: other threads keep reading meanwhile
    with _cache_lock:
        matcher = _cache.setdefault(key, built)
        if matcher is built:
            _cache_chars += built.num_chars
        _cache.move_to_end(key)
        while len(_cache) > 1 and (len(_cache) > _CACHE_MAX_ENTRIES or _cache_chars > _CACHE_MAX_CHARS):
            _, dropped = _cache.popitem(last=False)
            _cache_chars -= dropped.num_chars
    return matcher


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop: bool = False, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.tokens: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""  # decoded output so far (complete characters only)
        self.stopped_text: str | None = None  # final text once a stop string matched
        self._matcher = stop_matcher(stop) if stop else None
        self._state = 0  # the matcher's state after `text`
        self.chars_fed = 0  # characters of `text` fed to the matcher (each exactly once)
        # a fast tokenizer's Rust decoder directly (the same text without clean-up; a third of
        # the Python wrapper's time, and it runs twice per output token)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode = getattr(backend, "decode", None)

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special,
                                     clean_up_tokenization_spaces=False)

    def append(self, token_id: int) -> str | None:
        """Add one output token; return the stop string it completed, if any."""
        self.tokens.append(token_id)
        before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            new = after[len(before):]
            start = len(self.text)
            self.text += new
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            if self._matcher is not None:
                self._state, index, at = self._matcher.feed(self._state, new)
                self.chars_fed += len(new)
                if index >= 0:
                    return self._stopped(index, start + at)
        return None

    def extend(self, token_ids: list[int]) -> tuple[int, str | None]:
        """Add several output tokens (a verified draft path and its bonus token) with two
        decodes instead of two per token. Returns (how many were taken, the stop string the
        last of them completed, if any): all of them unless one completes a stop string,
        which ends the request there. The text is what `append` one by one gives (a window
        always starts where a complete character ended, so a character split over tokens
        decodes the same either way); where the batch ends inside a character or meets a stop
        string, it goes one by one from the state before the batch."""
        if len(token_ids) > 1:
            before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            after = self._decode(self.tokens[self.prefix_offset:] + token_ids)
            if len(after) > len(before) and not after.endswith("\ufffd"):
                new = after[len(before):]
                state, index = self._state, -1
                if self._matcher is not None:
                    state, index, _ = self._matcher.feed(self._state, new)
                if index < 0:
                    self.tokens += token_ids
                    self.text += new
                    self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
                    if self._matcher is not None:
                        self._state = state
                        self.chars_fed += len(new)
                    return len(token_ids), None
        for i, tok in enumerate(token_ids):
            stop = self.append(tok)
            if stop is not None:
                return i + 1, stop
        return len(token_ids), None

    def _stopped(self, index: int, at: int) -> str:
        """Finish at the stop string `self.stop[index]` found at text position `at`."""
        s = self.stop[index]
        self.stopped_text = self.text[:at + len(s)] if self.include_stop else self.text[:at]
        return s

    def flush(self) -> None:
        """At the end of a request: emit what was held back as an incomplete character."""
        if self.stopped_text is None and self.read_offset < len(self.tokens):
            before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            new = self._decode(self.tokens[self.prefix_offset:])[len(before):]
            self.text += new
            self.read_offset = len(self.tokens)
            if self._matcher is not None:
                self._state = self._matcher.feed(self._state, new)[0]
                self.chars_fed += len(new)

    def visible_text(self, finished: bool) -> str:
        if self.stopped_text is not None:
            return self.stopped_text
        if finished or self._matcher is None:
            return self.text
        return self.text[:len(self.text) - self._matcher.held(self._state)]
