"""Incremental detokenisation with stop strings.

`visible_text` only ever grows while a request runs, so a streaming frontend can send its
new suffix as a delta. It holds back (a) an incomplete UTF-8 sequence at the end (the
tokenizer decodes it as U+FFFD until its last byte arrives) and (b) a tail that could still
become a stop string. When a stop string completes, the text is cut right before it
(or after it with include_stop_str_in_output) and the request finishes at that token.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 6  # prompt tokens decoded ahead of the output so leading spaces come out right


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
        self._max_stop = max((len(s) for s in stop), default=0)
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
            start = len(self.text)
            self.text += after[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            if self.stop:
                return self._check_stop(start)
        return None

    def extend(self, token_ids: list[int]) -> tuple[int, str | None]:
        """Add several output tokens (a verified draft path and its bonus token) with two
        decodes instead of two per token. Returns (how many were taken, the stop string the
        last of them completed, if any): all of them unless one completes a stop string,
        which ends the request there. The text is what `append` one by one gives (a window
        always starts where a complete character ended, so a character split over tokens
        decodes the same either way); where the batch ends inside a character or meets a stop
        string, it goes one by one."""
        if len(token_ids) > 1:
            before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            after = self._decode(self.tokens[self.prefix_offset:] + token_ids)
            new = after[len(before):]
            if (len(after) > len(before) and not after.endswith("\ufffd")
                    and not (self.stop and self._stop_in(self.text, new))):
                self.tokens += token_ids
                self.text += new
                self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
                return len(token_ids), None
        for i, tok in enumerate(token_ids):
            stop = self.append(tok)
            if stop is not None:
                return i + 1, stop
        return len(token_ids), None

    def _stop_in(self, text: str, new: str) -> bool:
        """Whether appending `new` to `text` completes a stop string."""
        tail = text[max(0, len(text) - self._max_stop + 1):] + new
        return any(s in tail for s in self.stop)

    def _check_stop(self, new_from: int) -> str | None:
        window = max(0, new_from - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, window)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.stopped_text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        return s

    def flush(self) -> None:
        """At the end of a request: emit what was held back as an incomplete character."""
        if self.stopped_text is None and self.read_offset < len(self.tokens):
            before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.tokens[self.prefix_offset:])[len(before):]
            self.read_offset = len(self.tokens)

    def visible_text(self, finished: bool) -> str:
        if self.stopped_text is not None:
            return self.stopped_text
        if finished or not self.stop:
            return self.text
        return self.text[:len(self.text) - self._stop_prefix_len()]

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
