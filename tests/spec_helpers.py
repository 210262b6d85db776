"""Shared prompts and checks for the speculative-decoding tests (tests/test_spec_*.py)."""

from __future__ import annotations

TEXT = ("The city council met on Tuesday to discuss the new library. The new library will open "
        "in March and will have a large reading room, a children's section and a cafe. The "
        "council said the new library will cost four million dollars.")

# prompts where prompt lookup finds matches (repetition, quoting the text back)
HIT_PROMPTS = [
    "Repeat after me: the quick brown fox jumps over the lazy dog. the quick brown fox jumps "
    "over the lazy dog. the quick brown",
    f"{TEXT}\n\nSummarize the text above in one sentence, reusing its words.\nSummary: The",
]
# prompts with little to copy
MISS_PROMPTS = ["Write a haiku about autumn.", "What is 17 times 23?"]


def set_num_drafts(llm, k: int) -> None:
    """Use k drafts per step (<= the configured k) with adaptive length off: one engine
    serves k = 1, 3 and 5 instead of loading the model three times."""
    spec = llm.engine.spec
    configured = spec.__dict__.setdefault("configured_drafts", spec.max_drafts)
    assert k <= configured
    spec.policy.adaptive = False
    spec.max_drafts = k
    if spec.lookup is not None:
        spec.lookup.k = k


def check_tree(tree):
    """Assert DraftTree's invariants (parents first, distinct siblings, probabilities on chains
    only, depth first where it says so); returns the tree."""
    from specserve.spec_decode.draft_tree import preorder

    assert len(tree.tokens) == len(tree.parents) and all(-1 <= p < i for i, p in enumerate(tree.parents))
    assert not tree.dfs or preorder(tree.parents, range(len(tree))) == list(range(len(tree)))
    assert len(set(zip(tree.parents, tree.tokens))) == len(tree.tokens), "sibling tokens are distinct"
    assert tree.probs is None or (tree.probs.shape[0] == len(tree.tokens) and tree.is_chain)
    return tree


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def check_prefix_cache(engine, sequences: list[list[int]]) -> None:
    """Every block key in the prefix cache is a full block of some committed sequence."""
    from specserve.kv_cache.manager import block_keys

    valid = {key for seq in sequences for key in block_keys(seq, engine.kv.block_size)}
    for key in engine.kv.pool._block_of:
        assert key in valid, "a cached block holds tokens that no request committed"


MAX_TOKENS = 32


def greedy_baseline(llm) -> dict[str, list[int]]:
    """Plain greedy outputs (MAX_TOKENS) of every test prompt, computed once per session."""
    cached = getattr(llm, "_spec_baseline", None)
    if cached is None:
        from specserve import SamplingParams

        prompts = HIT_PROMPTS + MISS_PROMPTS
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
        cached = llm._spec_baseline = dict(zip(prompts, token_ids(outs)))
    return cached
