"""Structured output: grammars compiled once, one matcher per request, the token masks of every
verify row.

The grammar engine is llguidance (Microsoft, MIT; also a back-end of vLLM, SGLang and
llama.cpp). Why it and not xgrammar: it has no dependencies (one abi3 wheel, no torch, triton or
TVM runtime to match), computes a mask in tens of microseconds on a CPU with nothing compiled
ahead per vocabulary, takes JSON schema, regex and Lark grammars (GBNF converts), and its
matchers roll back, which verifying drafts needs.

A request's constraint (`StructuredOutput`, from `response_format`, the vLLM `guided_*` /
`structured_outputs` fields, or a tool choice) compiles to an llguidance grammar; `Grammars`
caches one compiled matcher per grammar and hands each request a copy. `Matcher` follows the
request's committed output tokens and computes masks for a draft tree: the row of the root
(the state after the committed tokens) and of every node (the state after its ancestors and
itself), walking the tree depth first with rollbacks. A draft token the grammar forbids at its
parent cuts that node and its subtree before verification (it could never be accepted).

Constraints come from clients, so their cost is bounded: `StructuredOutput.check` rejects, before
anything is compiled, more than MAX_CHOICES choices, more than MAX_CONSTRAINT_CHARS characters of
schema / regex / grammar (or of all the choices together) and JSON schemas nested deeper than
MAX_SCHEMA_DEPTH (found by a scan of the text, never by recursion); llguidance runs under
PARSER_LIMITS, which bound the work of compiling and of each mask; and whatever llguidance
reports or raises (a Rust panic included, which pyo3 raises as a BaseException) becomes a
ValueError "<field>: <the message, no backtrace or state dump>". `Grammars.compile` may be
called from several threads at once (an HTTP worker pool compiling ahead, and the engine thread):
llguidance drops the GIL while it builds a matcher.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

MAX_CACHED_GRAMMARS = 128  # compiled matchers (and compile errors) kept, least recently used out
MAX_CHOICES = 1024  # strings of a choice constraint
MAX_CONSTRAINT_CHARS = 65536  # a schema's, regex's or grammar's text, or all the choices together
MAX_SCHEMA_DEPTH = 32  # nesting of a JSON schema's text: objects and arrays, the outermost is 1
MAX_ERROR_CHARS = 300  # of llguidance's message in a ValueError (no backtrace, no dump)

# llguidance's LLParserLimits (its defaults in comments). The heaviest legitimate constraints
# measured (a 60 KB JSON schema of 300+ properties with patterns, formats, enums and nested
# arrays; 1,024 choices of 64 characters; a 48 KB regex of 5,000 alternatives) need at most
# max_items_in_row 1,025, initial_lexer_fuel 73,180 (89,557 for 63 KB of 9,364 alternatives),
# step_lexer_fuel 11,371, step_max_items 18, max_lexer_states 6,074 and max_grammar_size 2,165;
# the constraints of the tests need far less. Each value is several times that, and well under
# the defaults where those let a hostile grammar spend CPU (lexer fuel: "(a{1000}){1000}" took
# 0.7-1.6 s in its first mask under the defaults, 0.2-0.35 s to compile under these) or memory
# (lexer states, 1-2 kB each). A grammar past a limit fails to compile (ValueError), or, if it
# gets there only while generating, puts its request's matcher in error (EOS only from then on).
PARSER_LIMITS = {
    "max_items_in_row": 2_000,  # (2,000) Earley items per row: a choice of n strings needs n + 1
    "initial_lexer_fuel": 250_000,  # (1,000,000) building the lexer's regexes, ~50k/ms
    "step_lexer_fuel": 100_000,  # (200,000) the lexer's work in one mask, ~14k/ms
    "step_max_items": 20_000,  # (50,000) Earley items made in one mask, ~20k/ms
    "max_lexer_states": 50_000,  # (250,000) lexer DFA states, 1-2 kB each
    "max_grammar_size": 50_000,  # (500,000) symbols in productions; also keeps llguidance under
                                 # its 65,525-symbol assertion (a panic) that 200,000 choices hit
    "verbose_errors": False,  # (True) no parser state or grammar dumped into error messages
}

# in JSON text: a string (to its end, if unterminated) or a bracket
_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)


def json_depth(text: str, stop: int | None = None) -> int:
    """How deep objects and arrays nest in JSON text (0: none, 1: '{}' or '[]'), brackets
    inside strings not counted; a scan, no recursion. Stops once past `stop`, if given."""
    depth = deepest = 0
    for m in _JSON_TOKENS.finditer(text):
        c = m.group()
        if c == "{" or c == "[":
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop is not None and deepest > stop:
                    break
        elif (c == "}" or c == "]") and depth:
            depth -= 1  # (an unmatched one, invalid JSON, counts for nothing)
    return deepest


def _is_panic(e: BaseException) -> bool:
    """Whether e is pyo3's PanicException (a Rust panic; it derives from BaseException and its
    class, one per extension module, cannot be imported)."""
    return type(e).__name__ == "PanicException"


def _first_line(message: str) -> str:
    """llguidance's message up to what it appends after a line of its own in angle brackets
    (<backtrace>, <state>, <non-verbose/>), on one line, cut to MAX_ERROR_CHARS."""
    lines = []
    for line in message.strip().splitlines():
        if line.startswith("<"):
            break
        lines.append(line.strip())
    text = " ".join(x for x in lines if x) or "unknown error"
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


def _panic_message(e: BaseException) -> str:
    """A panic's message: its first line (what a panic hook may add after it is no one's business)."""
    return _first_line(str(e).strip().split("\n", 1)[0])


def _failure(param: str, e: BaseException) -> ValueError:
    """The ValueError a failure of llguidance (or of the GBNF converter) becomes."""
    if _is_panic(e):
        return ValueError(f"{param}: the grammar engine failed ({_panic_message(e)})")
    if isinstance(e, RecursionError):  # the GBNF converter is recursive descent, in Python
        return ValueError(f"{param}: the grammar nests too deeply")
    return ValueError(f"{param}: {_first_line(str(e) or type(e).__name__)}")


def parser_limits():
    """PARSER_LIMITS as llguidance's LLParserLimits."""
    import llguidance

    return llguidance.LLParserLimits(**PARSER_LIMITS)


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's output (exactly one field set)."""

    json: str | None = None  # a JSON schema, as text ('{"type": "object"}' for json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect; GBNF with "::=" is converted)
    param: str = "response_format"  # the request field it came from, for errors

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.json, self.regex, self.choice, self.grammar)) != 1:
            raise ValueError(f"{self.param}: exactly one of json, regex, choice, grammar")

    def check(self) -> None:
        """Raise ValueError naming the field if the constraint is malformed or past a limit
        (MAX_CHOICES, MAX_CONSTRAINT_CHARS, MAX_SCHEMA_DEPTH). Cheap (no llguidance, the JSON
        parsed at most once, after the depth scan): run it before compiling."""
        self._checked_schema()

    def _checked_schema(self) -> dict | None:
        """check(); the JSON schema parsed, for a json constraint."""
        p = self.param
        if self.choice is not None:
            if not isinstance(self.choice, (tuple, list)) or not self.choice:
                raise ValueError(f"{p}: choice must be a non-empty list of non-empty strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"{p}: {len(self.choice)} choices; at most {MAX_CHOICES}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"{p}: choice must be a non-empty list of non-empty strings")
            total = sum(map(len, self.choice))
            if total > MAX_CONSTRAINT_CHARS:
                raise ValueError(f"{p}: the choices total {total} characters; at most {MAX_CONSTRAINT_CHARS}")
            return None
        kind, text = next((k, t) for k, t in (("JSON schema", self.json), ("regex", self.regex),
                                              ("grammar", self.grammar)) if t is not None)
        if not isinstance(text, str):
            raise ValueError(f"{p}: the {kind} must be a string")
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"{p}: the {kind} is {len(text)} characters; at most {MAX_CONSTRAINT_CHARS}")
        if self.json is None:
            return None
        if json_depth(text, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{p}: the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError; ints past Python's digit limit
            raise ValueError(f"{p}: the JSON schema is not valid JSON ({_first_line(str(e))})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"{p}: the JSON schema must be an object")
        return schema

    def grammar_text(self) -> str:
        """The constraint as an llguidance grammar (check() first); ValueError naming the field."""
        schema = self._checked_schema()
        try:
            import llguidance

            if schema is not None:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    schema, defaults={"whitespace_flexible": False})
            if self.regex is not None:
                return llguidance.LLMatcher.grammar_from_regex(self.regex)
            if self.choice is not None:
                return llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in self.choice))
            text = self.grammar
            if "::=" in text:
                from llguidance.gbnf_to_lark import gbnf_to_lark

                text = gbnf_to_lark(text)
            return llguidance.LLMatcher.grammar_from_lark(text)
        except Exception as e:  # noqa: BLE001 - bad input (GBNF syntax, a schema serde rejects)
            raise _failure(self.param, e) from None
        except BaseException as e:
            if not _is_panic(e):
                raise
            raise _failure(self.param, e) from None


class Grammars:
    """The tokenizer as llguidance sees it, and compiled grammars by constraint (LRU).

    Thread-safe: `compile` and `matcher` may run in several threads at once (an HTTP worker pool
    compiling ahead, the engine thread). A lock guards the cache; a matcher is built outside it
    (llguidance drops the GIL meanwhile), once per constraint however many threads ask for it at
    the same time (the others wait for that one's result). Compile errors are cached too: a bad
    constraint sent again costs a lookup. Cached matchers are never advanced, only copied."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance.hf
        import llguidance.torch  # noqa: F401 - its import compiles a kernel (~2 s): here, not mid-step

        self.vocab_size = vocab_size  # the model's: mask rows are cut to it
        self.eos = set(eos_token_ids)
        n_vocab = max(vocab_size, len(tokenizer))
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=sorted(eos_token_ids))
        self.words = (n_vocab + 31) // 32
        self._lock = threading.Lock()
        # by constraint: the compiled matcher, or the message of its compile error
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._building: dict[StructuredOutput, threading.Event] = {}  # being compiled by a thread

    def compile(self, spec: StructuredOutput):
        """The compiled matcher of a constraint (cached); ValueError naming the field if it is
        malformed, past a limit (StructuredOutput.check, PARSER_LIMITS) or rejected by llguidance."""
        while True:
            with self._lock:
                found = self._compiled.get(spec)
                if found is not None:
                    self._compiled.move_to_end(spec)
                    break
                pending = self._building.get(spec)
                if pending is None:
                    pending = self._building[spec] = threading.Event()
                    mine = True
                else:
                    mine = False
            if not mine:
                pending.wait()  # another thread compiles it: take its result (or compile if it
                continue        # was interrupted, or already evicted)
            try:
                found = self._build(spec)
            except ValueError as e:
                found = str(e)
            finally:
                with self._lock:
                    if found is not None:
                        self._compiled[spec] = found
                        while len(self._compiled) > MAX_CACHED_GRAMMARS:
                            self._compiled.popitem(last=False)
                    del self._building[spec]
                pending.set()
            break
        if isinstance(found, str):
            raise ValueError(found)
        return found

    def _build(self, spec: StructuredOutput):
        """A matcher of the constraint in its initial state, its first mask computed (that
        builds the lexer states a copy starts with, here rather than on the engine thread, and
        finds grammars that fail only once used); ValueError naming the field."""
        text = spec.grammar_text()  # check()s first
        import llguidance

        try:
            matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=parser_limits())
            if not matcher.is_error():
                matcher.compute_bitmask()
            error = matcher.get_error() if matcher.is_error() else None
        except Exception as e:  # noqa: BLE001 - llguidance reports errors in the matcher; anything
            raise _failure(spec.param, e) from None  # raised is a bug of its own: still the field's
        except BaseException as e:
            if not _is_panic(e):
                raise
            raise _failure(spec.param, e) from None
        if error is not None:
            raise ValueError(f"{spec.param}: {_first_line(error)}")
        return matcher

    def matcher(self, spec: StructuredOutput) -> "Matcher":
        try:
            copy = self.compile(spec).deep_copy()
        except BaseException as e:
            if not _is_panic(e):
                raise
            raise _failure(spec.param, e) from None
        return Matcher(copy, self.words, self.vocab_size, self.eos)


class Matcher:
    """One request's grammar state: its committed output tokens consumed."""

    def __init__(self, matcher, words: int, vocab_size: int, eos: set[int]) -> None:
        self.m = matcher
        self.words, self.vocab_size, self.eos = words, vocab_size, eos
        self._path: list[int] = []  # draft nodes consumed past the committed tokens
        # the mask row after an EOS (EOS only, as llguidance's), by word: int32 values
        bits: dict[int, int] = {}
        for e in eos:
            if e < words * 32:
                bits[e >> 5] = bits.get(e >> 5, 0) | 1 << (e & 31)
        self._eos_row = {w: v - (1 << 32) if v >= 1 << 31 else v for w, v in bits.items()}

    def consume(self, tokens: list[int]) -> None:
        try:
            for t in tokens:
                if self.m.is_stopped() or not self.m.consume_token(t):
                    break  # past the grammar's end (EOS, or tokens a stop string cut): nothing to follow
        except BaseException as e:
            if not _is_panic(e):
                raise
            raise _runtime_failure(e) from None

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.m, bitmask, row)

    def tree_masks(self, tokens: list[int], parents: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Bit masks (int32 [1 + n, words]) of the root and of every node of a draft tree, and
        the nodes the grammar allows (parents first; a forbidden node cuts its subtree)."""
        try:
            return self._tree_masks(tokens, parents)
        except BaseException as e:
            if not _is_panic(e):
                raise
            raise _runtime_failure(e) from None

    def _tree_masks(self, tokens: list[int], parents: list[int]) -> tuple[torch.Tensor, list[int]]:
        bitmask = torch.zeros(1 + len(tokens), self.words, dtype=torch.int32)
        self._fill(bitmask, 0)
        children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]
        for i, p in enumerate(parents):
            children[p + 1].append(i)
        rows = bitmask.numpy()
        allowed: list[int] = []
        stack = [(c, -1) for c in reversed(children[0])]  # (node, parent): depth first
        depth_of = {-1: 0}
        while stack:
            node, parent = stack.pop()
            while len(self._path) > depth_of[parent]:
                self.m.rollback(1)
                self._path.pop()
            tok = tokens[node]
            word = rows[parent + 1, tok >> 5] if tok < self.vocab_size else 0
            if not (int(word) >> (tok & 31)) & 1 or (parent >= 0 and tokens[parent] in self.eos):
                continue  # forbidden here (or after the end): the node and its subtree go
            if tok in self.eos:  # allowed: the end, its subtree cut. Not consumed: llguidance
                allowed.append(node)  # keeps no EOS in its history, so rolling one back would
                for w, v in self._eos_row.items():  # undo the token before it
                    rows[node + 1, w] = v
                continue
            self.m.consume_token(tok)
            self._path.append(node)
            depth_of[node] = len(self._path)
            allowed.append(node)
            self._fill(bitmask, node + 1)
            stack.extend((c, node) for c in reversed(children[node + 1]))
        if self._path:
            self.m.rollback(len(self._path))
            self._path.clear()
        allowed.sort()
        return bitmask, allowed


def _runtime_failure(e: BaseException) -> RuntimeError:
    """A Rust panic in a request's matcher as an Exception (the engine step fails its live
    requests and goes on; a BaseException would end the engine thread)."""
    return RuntimeError(f"structured output: the grammar engine failed ({_panic_message(e)})")


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [n, words] bit masks -> bool [n, vocab_size] (True: allowed); a row that allows
    nothing (a state past the grammar's end) allows everything, so no row is all -inf."""
    bitmask = bitmask[:, :(vocab_size + 31) // 32]
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.flatten(1)[:, :vocab_size].bool()
    return allowed | ~allowed.any(-1, keepdim=True)


def cut(tree, matcher: Matcher, marked: list[int]):
    """A draft tree's nodes that the grammar allows (a forbidden node takes its subtree) ->
    (the tree, the bit masks of its root and of each kept node, `marked` node indices
    re-indexed into it)."""
    masks, allowed = matcher.tree_masks(tree.tokens, tree.parents)
    masks = masks[[0] + [n + 1 for n in allowed]]
    if len(allowed) == len(tree):
        return tree, masks, marked
    index = {old: new for new, old in enumerate(allowed)}
    return tree.select(allowed), masks, [index[n] for n in marked if n in index]


def constrain(logits: torch.Tensor, requests: list, states: list, trees: list, starts: list[int],
              vocab_size: int) -> torch.Tensor:
    """The logits of one step with every constrained request's rows changed: masked by its
    grammar (the root's row and every draft node's, each in the state after the drafts
    before it), its logit_bias added, EOS and stop ids banned before min_tokens. states: the
    decoder's per-request state (`grammar`, `masks`) of requests with a grammar, else None;
    trees: each request's verified draft tree; starts: its first row. Returns a copy when anything
    changes (logprobs report the model's own distribution)."""
    out, grammar_rows, masks = logits, [], []
    for req, state, tree, start in zip(requests, states, trees, starts):
        p = req.params
        if not p.constrained:
            continue
        if out is logits:
            out = logits.clone()
        rows = list(range(start, start + len(tree) + 1))
        if p.structured is not None:  # masks made when the drafts were chosen, if any
            grammar_rows += rows
            masks.append(state.masks[:len(rows)] if state.masks is not None
                         else state.grammar.tree_masks(tree.tokens, tree.parents)[0])
        if p.logit_bias:
            apply_bias(out, rows, p.logit_bias)
        if p.min_tokens:
            early = [r for r, d in zip(rows, [0] + tree.depth) if req.num_output_tokens + d < p.min_tokens]
            stops = sorted(set(req.eos_token_ids) | set(p.stop_token_ids))
            if early and stops:
                ban(out, early, stops)
    if grammar_rows:  # one masking call for every grammar row of the step
        index = torch.tensor(grammar_rows, device=logits.device)
        allowed = unpack(torch.cat(masks), vocab_size).to(logits.device)
        out[index] = out[index].masked_fill(~allowed, float("-inf"))
    return out


def _grid(logits: torch.Tensor, rows: list[int], ids: list[int]):
    device = logits.device
    return (torch.tensor(rows, dtype=torch.int64, device=device)[:, None],
            torch.tensor(ids, dtype=torch.int64, device=device)[None, :])


def apply_bias(logits: torch.Tensor, rows: list[int], bias: dict[int, float]) -> None:
    """Add a request's logit_bias to its rows of logits (in place)."""
    logits[_grid(logits, rows, list(bias))] += torch.tensor(list(bias.values()), dtype=logits.dtype,
                                                             device=logits.device)


def ban(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> None:
    """Forbid tokens (EOS before min_tokens) in some rows (in place)."""
    logits[_grid(logits, rows, token_ids)] = float("-inf")
