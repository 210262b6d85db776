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
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

import torch

MAX_CACHED_GRAMMARS = 128


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

    def grammar_text(self) -> str:
        import llguidance

        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"{self.param}: the JSON schema is not valid JSON ({e})") from None
            if not isinstance(schema, dict):
                raise ValueError(f"{self.param}: the JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False})
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"{self.param}: choice must be a non-empty list of non-empty strings")
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in self.choice))
        text = self.grammar
        if "::=" in text:
            text = llguidance.gbnf_to_lark(text)
        return llguidance.LLMatcher.grammar_from_lark(text)


class Grammars:
    """The tokenizer as llguidance sees it, and compiled grammars by text (LRU)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size  # the model's: mask rows are cut to it
        self.eos = set(eos_token_ids)
        n_vocab = max(vocab_size, len(tokenizer))
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=sorted(eos_token_ids))
        self.words = (n_vocab + 31) // 32
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()  # by constraint

    def compile(self, spec: StructuredOutput):
        """The compiled matcher of a constraint (cached); ValueError naming the field if bad."""
        import llguidance

        matcher = self._compiled.get(spec)
        if matcher is None:
            matcher = llguidance.LLMatcher(self.tokenizer, spec.grammar_text(), log_level=0)
            if matcher.is_error():
                raise ValueError(f"{spec.param}: {matcher.get_error().strip()}")
            self._compiled[spec] = matcher
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(spec)
        return matcher

    def matcher(self, spec: StructuredOutput) -> "Matcher":
        return Matcher(self.compile(spec).deep_copy(), self.words, self.vocab_size, self.eos)


class Matcher:
    """One request's grammar state: its committed output tokens consumed."""

    def __init__(self, matcher, words: int, vocab_size: int, eos: set[int]) -> None:
        self.m = matcher
        self.words, self.vocab_size, self.eos = words, vocab_size, eos
        self._path: list[int] = []  # draft nodes consumed past the committed tokens

    def consume(self, tokens: list[int]) -> None:
        for t in tokens:
            if self.m.is_stopped() or not self.m.consume_token(t):
                break  # past the grammar's end (EOS, or tokens a stop string cut): nothing to follow

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.m, bitmask, row)

    def tree_masks(self, tokens: list[int], parents: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Bit masks (int32 [1 + n, words]) of the root and of every node of a draft tree, and
        the nodes the grammar allows (parents first; a forbidden node cuts its subtree)."""
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
