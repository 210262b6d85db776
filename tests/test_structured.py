"""Structured output, logit_bias and min_tokens at the engine: replies follow their grammar,
greedy replies are identical with and without speculation (every verify row masked by the
grammar state after the drafts before it), drafts the grammar forbids are cut before
verification, and bad constraints are clear errors. The sampled case (chi-square) is in
test_spec_sampled.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specserve import SamplingParams
from specserve.structured import Grammars, StructuredOutput, unpack

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
PROMPTS = ["Describe a person called Ada as JSON.", "Write a JSON object about a cat."]


@pytest.fixture(scope="module")
def eagle_llm(make_llm):
    # not adaptive: the head drafts its maximum and everything is verified, so drafts meet the grammar
    return make_llm(max_model_len=2048, speculative_config={"method": "eagle", "adaptive": False})


def chat(llm, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def generate(llm, constraint: StructuredOutput | None, max_tokens: int = 64, **kw) -> list:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured=constraint, **kw)
    return [o.outputs[0] for o in llm.generate([chat(llm, p) for p in PROMPTS], params)]


@pytest.mark.parametrize("constraint", [
    StructuredOutput(json=json.dumps(SCHEMA)),
    StructuredOutput(json='{"type": "object"}'),
    StructuredOutput(regex=r"[A-Z][a-z]+ is \d{1,2} years old\."),
    StructuredOutput(choice=("yes", "no", "maybe")),
], ids=["json_schema", "json_object", "regex", "choice"])
def test_replies_follow_the_grammar_and_speculation_changes_nothing(llm, eagle_llm, constraint):
    plain = generate(llm, constraint)
    stats = eagle_llm.engine.stats
    drafted = stats.spec_num_draft_tokens
    spec = generate(eagle_llm, constraint)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert constraint.choice or stats.spec_num_draft_tokens > drafted  # drafts verified under the grammar
    for out in plain:
        if constraint.json == '{"type": "object"}':  # any object: a small model may ramble past 64 tokens
            assert out.text.startswith("{")
            continue
        assert out.finish_reason == "stop", out.text  # the grammar ended the reply
        if constraint.json is not None:
            jsonschema.validate(json.loads(out.text), json.loads(constraint.json))
        elif constraint.choice is not None:
            assert out.text in constraint.choice
        else:
            assert out.text[0].isupper() and out.text.endswith("years old.")


def test_logit_bias_and_min_tokens(llm, eagle_llm):
    token = llm.engine.tokenizer.encode(" banana")[0]
    for engine in (llm, eagle_llm):
        forced = generate(engine, None, max_tokens=8, logit_bias={token: 100})
        assert all(o.token_ids == [token] * 8 for o in forced)
    eos = set(llm.engine.eos_token_ids)
    short = generate(llm, StructuredOutput(choice=("yes", "no")), max_tokens=8)
    assert all(o.text in ("yes", "no") and o.finish_reason == "stop" for o in short)
    # min_tokens bans EOS and stop tokens until that many tokens are out
    free = generate(llm, None, max_tokens=40, min_tokens=40)
    assert all(len(o.token_ids) == 40 and not eos & set(o.token_ids) for o in free)
    assert [o.token_ids for o in generate(eagle_llm, None, max_tokens=40, min_tokens=40)] == \
        [o.token_ids for o in free]


def test_forbidden_drafts_are_cut_and_masks_never_empty(llm):
    grammars: Grammars = llm.engine.grammars
    tok = llm.engine.tokenizer
    m = grammars.matcher(StructuredOutput(choice=("yes", "no")))
    yes, no, other = tok.encode("yes")[0], tok.encode("no")[0], tok.encode("maybe")[0]
    # root -> yes -> EOS, root -> other (forbidden) -> yes (its subtree), root -> no
    eos = sorted(llm.engine.eos_token_ids)[-1]
    masks, allowed = m.tree_masks([yes, other, eos, yes, no], [-1, -1, 0, 1, -1])
    assert allowed == [0, 2, 4]
    rows = unpack(masks, llm.engine.arch.vocab_size)
    assert rows[0, yes] and rows[0, no] and not rows[0, other]
    assert rows.any(-1).all()
    assert m.tree_masks([], [])[0].shape[0] == 1  # the walk rolled everything back


@pytest.mark.parametrize("constraint, field", [
    (StructuredOutput(json="{not json"), "response_format"),
    (StructuredOutput(regex="(unclosed", param="guided_regex"), "guided_regex"),
    (StructuredOutput(grammar="start: undefined_rule", param="structured_outputs"), "structured_outputs"),
])
def test_bad_constraints_are_clear_errors(llm, constraint, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        llm.engine.validate([1, 2, 3], SamplingParams(structured=constraint))
    with pytest.raises(ValueError, match="^logit_bias: "):
        llm.engine.validate([1, 2, 3], SamplingParams(logit_bias={10**9: 1.0}))
