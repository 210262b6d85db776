"""specserve bench spec: prompt selection and option checks (no model runs here)."""

import pytest

from specserve.bench.spec import CATEGORIES, MT_BENCH, _variants, load_prompts


def test_prompts_per_category_and_mt_bench_split():
    five = load_prompts(CATEGORIES, 5)
    assert [c for c, _ in five] == [c for c in CATEGORIES for _ in range(5)]
    split = load_prompts(["mt_bench"], 1, mt_bench_split=True)
    assert sorted(c for c, _ in split) == sorted(f"mt_bench/{c}" for c in MT_BENCH)  # one per sub-category
    assert len({t for _, t in split}) == 8
    assert load_prompts(["mt_bench"], 1)[0] == (split[0][0].split("/")[0], split[0][1])


def test_eagle_variants_parse_or_fail_clearly():
    assert _variants(['p0={"min_draft_prob": 0}', 'm12={"num_speculative_tokens": 12}']) == [
        ("p0", {"min_draft_prob": 0}), ("m12", {"num_speculative_tokens": 12})]
    for bad in ['p0', 'p0={"min_draft_prob": ', '={"a": 1}', 'x=[1]']:
        with pytest.raises(ValueError, match="--eagle-variant"):
            _variants([bad])
