"""Structured output against hostile constraints, with the default model's tokenizer (no model):
every limit (choices, characters, JSON nesting) is a ValueError naming the request field, found
before anything is compiled and never by recursion; whatever llguidance reports or raises (a Rust
panic too) is a ValueError without a backtrace; GBNF grammars convert; `Grammars` compiles from
several threads at once, each constraint once; a draft tree's EOS node leaves the committed
state alone."""

from __future__ import annotations

import json
import threading

import llguidance
import pytest

from specserve import structured
from specserve.structured import (MAX_CHOICES, MAX_CONSTRAINT_CHARS, MAX_SCHEMA_DEPTH, PARSER_LIMITS, Grammars,
                                  StructuredOutput, json_depth, parser_limits)


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def eos(tok) -> int:
    return tok.eos_token_id


@pytest.fixture
def grammars(tok, eos) -> Grammars:
    return Grammars(tok, len(tok), [eos])


def accepts(grammars: Grammars, tok, eos: int, spec: StructuredOutput, text: str) -> bool:
    """Whether the constraint admits `text` then EOS: every node of the chain survives the walk."""
    ids = tok.encode(text, add_special_tokens=False) + [eos]
    _, allowed = grammars.matcher(spec).tree_masks(ids, list(range(-1, len(ids) - 1)))
    return allowed == list(range(len(ids)))


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# -- limits --------------------------------------------------------------------------------------

LIMITED = [
    (StructuredOutput(json="[" * 5000, param="guided_json"), "guided_json", "nests deeper than 32"),
    (StructuredOutput(json="{" * 5000, param="guided_json"), "guided_json", "nests deeper than 32"),
    (StructuredOutput(json=json.dumps(nested_schema(20))), "response_format", "nests deeper than 32"),
    (StructuredOutput(choice=tuple(f"c{i}" for i in range(MAX_CHOICES + 1)), param="guided_choice"),
     "guided_choice", "1025 choices; at most 1024"),
    (StructuredOutput(choice=tuple(str(i) * 100 for i in range(1000)), param="structured_outputs"),
     "structured_outputs", "characters; at most 65536"),
    (StructuredOutput(grammar='start: "a"\n' + "// padding\n" * 7000, param="guided_grammar"),
     "guided_grammar", "the grammar is 77011 characters; at most 65536"),
    (StructuredOutput(regex="a" * 70_000, param="guided_regex"), "guided_regex", "at most 65536"),
    (StructuredOutput(json=json.dumps({"description": "x" * 70_000})), "response_format", "at most 65536"),
    (StructuredOutput(json="[1, 2]"), "response_format", "must be an object"),
    (StructuredOutput(json='{"maximum": 1' + "0" * 5000 + "}"), "response_format", "not valid JSON"),
    (StructuredOutput(choice=("a", ""), param="guided_choice"), "guided_choice", "non-empty strings"),
    (StructuredOutput(choice=(), param="guided_choice"), "guided_choice", "non-empty list"),
]


@pytest.mark.parametrize("spec, field, message", LIMITED, ids=[
    "5000 brackets", "5000 braces", "deep schema", "1025 choices", "choices' characters", "70 KB grammar",
    "70 KB regex", "70 KB schema", "not an object", "huge integer", "empty choice", "no choices"])
def test_limits_are_value_errors_naming_the_field(grammars, spec, field, message):
    for call in (spec.check, spec.grammar_text, lambda: grammars.compile(spec), lambda: grammars.matcher(spec)):
        with pytest.raises(ValueError, match=f"^{field}: ") as e:  # a RecursionError would fail here
            call()
        assert message in str(e.value) and "\n" not in str(e.value)


def test_the_limits_themselves_pass(grammars, tok, eos):
    choices = tuple(f"{i:04d}" + "x" * 60 for i in range(MAX_CHOICES))  # 1,024 of 64: 65,536 characters
    assert sum(map(len, choices)) == MAX_CONSTRAINT_CHARS
    spec = StructuredOutput(choice=choices)
    assert accepts(grammars, tok, eos, spec, choices[777])
    assert not accepts(grammars, tok, eos, spec, "0777")
    # objects and arrays 32 deep (the outermost counts), brackets inside strings don't
    deep = {"type": "array", "items": {"type": "integer"}, "description": "[[[{{{" * 1000}  # 2 levels
    for _ in range(MAX_SCHEMA_DEPTH - 2):  # one more each
        deep = {"type": "array", "items": deep}
    assert json_depth(json.dumps(deep)) == MAX_SCHEMA_DEPTH
    arrays = "[" * 30 + "[1,2]" + "]" * 30  # 31 arrays: one per schema level
    assert accepts(grammars, tok, eos, StructuredOutput(json=json.dumps(deep)), arrays)
    assert accepts(grammars, tok, eos, StructuredOutput(regex="a" * 1000), "a" * 1000)


@pytest.mark.parametrize("text, depth", [
    ("", 0), ("1", 0), ("{}", 1), ("[[], {}]", 2), ('{"a": [{"b": 1}]}', 3), ('{"a": "[[[{{"}', 1),
    (r'{"a": "\"[[[", "b": [1]}', 2), (r'["\\", [2]]', 2), ('["[[[', 1), ("]]][[", 2),
])
def test_json_depth_scans_brackets_outside_strings(text, depth):
    assert json_depth(text) == depth


def test_json_depth_stops_early():
    assert json_depth("[" * 100_000, stop=MAX_SCHEMA_DEPTH) == MAX_SCHEMA_DEPTH + 1


def test_parser_limits_are_passed(grammars, monkeypatch):
    limits = parser_limits()
    assert {k: getattr(limits, k) for k in PARSER_LIMITS} == PARSER_LIMITS
    seen = []
    real = llguidance.LLMatcher

    class Spy:
        grammar_from_regex = staticmethod(real.grammar_from_regex)

        def __new__(cls, tokenizer, grammar, **kw):
            seen.append(kw["limits"])
            return real(tokenizer, grammar, **kw)

    monkeypatch.setattr(llguidance, "LLMatcher", Spy)
    grammars.compile(StructuredOutput(regex="[a-z]+"))
    assert len(seen) == 1 and seen[0].max_lexer_states == PARSER_LIMITS["max_lexer_states"]


def test_llguidance_errors_are_short(grammars):
    for spec in (StructuredOutput(regex="(unclosed", param="guided_regex"),
                 StructuredOutput(grammar="start: " + "(" * 5000 + '"a"' + ")" * 5000, param="guided_grammar"),
                 StructuredOutput(json='{"type": "integer", "minimum": 5, "maximum": 1}', param="guided_json"),
                 StructuredOutput(grammar="start: %json " + '{"type": "array", "items": ' * 200 + "{}" + "}" * 200,
                                  param="tool_choice")):
        with pytest.raises(ValueError, match=f"^{spec.param}: ") as e:
            grammars.compile(spec)
        text = str(e.value)
        assert "\n" not in text and "<state>" not in text and "<backtrace>" not in text
        assert len(text) <= len(spec.param) + 2 + structured.MAX_ERROR_CHARS


# -- GBNF ----------------------------------------------------------------------------------------

def test_gbnf_grammars_convert_and_constrain(grammars, tok, eos):
    gbnf = 'root ::= answer " " num\nanswer ::= "yes" | "no"\nnum ::= [0-9]+\n'
    spec = StructuredOutput(grammar=gbnf, param="guided_grammar")
    assert "start" in spec.grammar_text()
    assert accepts(grammars, tok, eos, spec, "yes 42")
    assert accepts(grammars, tok, eos, spec, "no 7")
    assert not accepts(grammars, tok, eos, spec, "maybe 42")
    assert not accepts(grammars, tok, eos, spec, "yes")
    for bad, message in (('root ::= "yes', "Unexpected end of input"),
                         ("root ::= " + "(" * 3000 + '"a"' + ")" * 3000, "nests too deeply")):
        with pytest.raises(ValueError, match=f"^guided_grammar: .*{message}"):
            grammars.compile(StructuredOutput(grammar=bad, param="guided_grammar"))


# -- panics --------------------------------------------------------------------------------------

class PanicException(BaseException):
    """Stands for pyo3's (same name, a BaseException; the real class cannot be imported)."""


def fake_matcher(monkeypatch, **behaviour):
    real = llguidance.LLMatcher

    class Fake:
        grammar_from_regex = staticmethod(real.grammar_from_regex)

        def __new__(cls, *args, **kw):
            if "new" in behaviour:
                raise behaviour["new"]
            return super().__new__(cls)

        def is_error(self):
            return "error" in behaviour

        def get_error(self):
            return behaviour.get("error", "")

        def compute_bitmask(self):
            return b""

    monkeypatch.setattr(llguidance, "LLMatcher", Fake)


def test_a_panic_while_compiling_is_a_value_error(grammars, monkeypatch):
    fake_matcher(monkeypatch, new=PanicException("assertion failed: x < y\nstack backtrace:\n  0: foo"))
    with pytest.raises(ValueError, match=r"^guided_regex: the grammar engine failed \(assertion failed: x < y\)$"):
        grammars.compile(StructuredOutput(regex="a+", param="guided_regex"))


def test_a_panic_caught_by_llguidance_shows_no_backtrace(grammars, monkeypatch):
    # what 200,000 choices gave: the matcher in error, a backtrace in the message
    fake_matcher(monkeypatch, error="panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n"
                                    "<backtrace>\n   0: <unknown>\n   1: <unknown>\n")
    with pytest.raises(ValueError) as e:
        grammars.compile(StructuredOutput(regex="b+", param="guided_regex"))
    assert str(e.value) == "guided_regex: panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10"


def test_other_base_exceptions_pass_through(grammars, monkeypatch):
    fake_matcher(monkeypatch, new=KeyboardInterrupt())
    spec = StructuredOutput(regex="c+")
    with pytest.raises(KeyboardInterrupt):
        grammars.compile(spec)
    assert not grammars._building  # and the next try compiles afresh
    monkeypatch.undo()
    grammars.compile(spec)


def test_a_panic_while_generating_is_a_runtime_error(grammars, tok):
    m = grammars.matcher(StructuredOutput(regex="[a-z]+"))

    class Panicking:
        def __getattr__(self, name):
            def fail(*args):
                raise PanicException("index out of bounds\n<backtrace>")
            return fail

    m.m = Panicking()
    for call in (lambda: m.consume([5]), lambda: m.tree_masks([5], [-1])):
        with pytest.raises(RuntimeError, match=r"^structured output: the grammar engine failed \(index out of "
                                               r"bounds\)$"):
            call()


# -- threads -------------------------------------------------------------------------------------

SPECS = [(StructuredOutput(regex=r"[A-Z][a-z]+ is \d{1,2}"), "Ada is 36", "ada is 36"),
         (StructuredOutput(choice=("yes", "no", "maybe")), "maybe", "perhaps"),
         (StructuredOutput(json='{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],'
                                ' "additionalProperties": false}'), '{"n":12}', '{"n":"12"}'),
         (StructuredOutput(grammar='root ::= "x" [0-9]+', param="guided_grammar"), "x123", "y123")]


def in_threads(n: int, fn) -> list:
    """fn(i) in n threads released together; their results (or exceptions)."""
    barrier, results = threading.Barrier(n), [None] * n

    def run(i):
        barrier.wait()
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_concurrent_compiles_of_one_spec_build_it_once(grammars, tok, eos, monkeypatch):
    builds = []
    real = grammars._build

    def slow_build(spec):
        builds.append(spec)
        threading.Event().wait(0.2)  # the other threads arrive meanwhile
        return real(spec)

    monkeypatch.setattr(grammars, "_build", slow_build)
    for spec, good, bad in SPECS:
        matchers = in_threads(4, lambda i: grammars.compile(spec))
        assert all(m is matchers[0] for m in matchers)
        assert accepts(grammars, tok, eos, spec, good) and not accepts(grammars, tok, eos, spec, bad)
    assert len(builds) == len(SPECS) and not grammars._building
    bad = StructuredOutput(regex="(unclosed", param="guided_regex")
    errors = in_threads(4, lambda i: grammars.compile(bad))
    assert all(isinstance(e, ValueError) and str(e) == str(errors[0]) for e in errors)
    assert str(errors[0]).startswith("guided_regex: ") and len(builds) == len(SPECS) + 1  # cached too


def test_concurrent_compiles_of_different_specs(grammars, tok, eos):
    for _ in range(3):
        grammars._compiled.clear()
        matchers = in_threads(4, lambda i: grammars.matcher(SPECS[i][0]))
        for (spec, good, bad), m in zip(SPECS, matchers):
            for text, want in ((good, True), (bad, False)):
                ids = tok.encode(text, add_special_tokens=False) + [eos]
                copy = grammars.matcher(spec)
                _, allowed = copy.tree_masks(ids, list(range(-1, len(ids) - 1)))
                assert (allowed == list(range(len(ids)))) == want, (spec, text)
            assert not isinstance(m, BaseException)
        assert set(grammars._compiled) == {s for s, _, _ in SPECS}
    # and many threads mixing hits, misses and evictions
    monkey = [StructuredOutput(regex=f"[a-z]{{{i}}}") for i in range(1, 200)]
    results = in_threads(4, lambda i: [grammars.compile(s) for s in monkey[i::2] + monkey[::-3]])
    assert not any(isinstance(r, BaseException) for r in results)
    assert len(grammars._compiled) <= structured.MAX_CACHED_GRAMMARS and not grammars._building


# -- draft trees ---------------------------------------------------------------------------------

def test_an_eos_node_leaves_the_committed_state_alone(grammars, tok, eos):
    """llguidance keeps no EOS in its history: rolling one back undid the token before it (the
    committed state then lost a token, and "1111" passed [0-9]{1,3})."""
    one = tok.encode("1", add_special_tokens=False)[0]
    m = grammars.matcher(StructuredOutput(regex="[0-9]{1,3}"))
    m.consume([one, one])  # committed "11"
    masks, allowed = m.tree_masks([one, eos, eos], [-1, 0, -1])  # "1" EOS, and EOS at the root
    assert allowed == [0, 1, 2]
    rows = structured.unpack(masks, len(tok))
    assert rows[2].sum() == 1 and rows[2, eos]  # after an EOS, only EOS (as llguidance has it)
    m.consume([one])  # committed "111": no fourth digit
    assert m.tree_masks([one, eos], [-1, -1])[1] == [1]
