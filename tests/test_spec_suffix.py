"""Suffix decoding (spec_decode/suffix.py): trees from the request's own text and its tenant's
earlier outputs, scored by frequency; lossless greedy output on the default model; tenants
never draft from each other's text; the corpus stays within its bound."""

from __future__ import annotations

import math
import random

import pytest

from specserve import SamplingParams
from specserve.spec_decode.draft_tree import ProposeBatch
from specserve.spec_decode.suffix import SuffixCorpus, SuffixIndex, SuffixProposer
from tests.spec_helpers import (HIT_PROMPTS, MAX_TOKENS, MISS_PROMPTS, check_prefix_cache,
                                check_tree, greedy_baseline, token_ids)

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def draft(tokens, k=8, corpus=None, proposer=None):
    proposer = proposer or SuffixProposer(k, 1, 6)
    index = SuffixIndex(proposer.min_n, proposer.max_n)
    index.sync(tokens)
    return proposer.draft(tokens, index, corpus or proposer.corpus(None), k)


def test_the_longest_suffix_continues_and_loops_continue_over_their_copy():
    # "2 3" came before "7 8 5" (most recently) and before "9 1": equally frequent, the most
    # recent continuation wins the tie
    tree = check_tree(draft([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], k=3))
    assert (tree.tokens, tree.parents) == ([7, 8, 5], [-1, 0, 1])
    tree = check_tree(draft([1, 2, 1, 2, 1, 2], k=5))
    assert tree.tokens == [1, 2, 1, 2, 1] and tree.is_chain
    assert draft([4, 5, 6]) is None


def test_the_index_finds_the_longest_earlier_suffix_and_all_its_occurrences():
    """SuffixIndex.matches against a search of every earlier position, on contexts grown in
    two syncs (a prompt, then output) with few symbols, so that matches are many and long."""
    rng = random.Random(2)
    for _ in range(300):
        tokens = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(2, 120))]
        max_n = rng.choice([1, 4, 12])
        index = SuffixIndex(1, max_n)
        index.sync(tokens[:rng.randrange(1, len(tokens) + 1)])
        index.sync(tokens)
        expect = (0, [])
        for n in range(min(max_n, len(tokens) - 1), 0, -1):
            after = [p for p in range(len(tokens) - 1, n - 1, -1) if tokens[p - n:p] == tokens[-n:]]
            if after:
                expect = (n, after)
                break
        m, positions = index.matches(tokens)
        assert (m, positions.tolist()) == expect, tokens


def test_frequent_continuations_come_first_and_longer_matches_draft_more():
    # after "5" came "6" twice and "8" once: two nodes for a one-token match
    tree = check_tree(draft([5, 6, 1, 5, 6, 2, 5, 8, 3, 5], k=8))
    assert (tree.tokens, tree.parents) == ([6, 8], [-1, -1])
    assert [math.exp(x) for x in tree.scores] == pytest.approx([2 / 3, 1 / 3])
    # a six-token match: up to 12 nodes
    text = [7, 1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 0, 1, 2, 3, 4, 5, 6]
    assert len(check_tree(draft(text, k=16))) == 12
    assert len(draft(text, k=4)) == 4


def test_random_sequences_give_valid_trees_within_k():
    rng = random.Random(0)
    proposer = SuffixProposer(12, 1, 5)
    drafted = []  # (tree, k) of every context that drafted
    for _ in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 60))]
        k = rng.randrange(1, 13)
        drafted.append((draft(tokens, k, proposer=proposer), k))
    drafted = [(check_tree(tree), k) for tree, k in drafted if tree is not None]
    assert len(drafted) >= 150  # four symbols: almost every context recurs
    assert all(1 <= len(tree) <= k and tree.dfs for tree, k in drafted)


def test_a_tenant_drafts_only_from_its_own_outputs():
    proposer = SuffixProposer(8, 1, 6)
    secret = [11, 12, 13, 14, 15, 16, 17, 18]
    proposer.remember("a", secret, "key-0")
    context = [1, 2, 11, 12, 13]

    def propose(tenant):
        batch = ProposeBatch([f"r-{tenant}"], [context], [4], -math.inf, [GREEDY], [0], [[]], [0],
                             [tenant])
        return proposer.propose(batch)[0]

    assert propose("key-0").tokens == [14, 15, 16, 17]
    assert propose("key-1") is None and propose(None) is None
    shared = SuffixProposer(8, 1, 6, shared_corpus=True)
    shared.remember("a", secret, "key-0")
    assert shared.draft(context, SuffixIndex(1, 6), shared.corpus("key-1"), 4).tokens == [14, 15, 16, 17]


def test_the_corpus_keeps_at_most_its_bound():
    corpus = SuffixCorpus(1, 4, max_tokens=100)
    rng = random.Random(1)
    for _ in range(50):
        corpus.add([rng.randrange(20) for _ in range(30)])
    assert corpus.num_tokens <= 100 and len(corpus.docs) == 3
    held = [t for doc in corpus.docs for t in doc + [-1]]  # the array holds the kept docs only
    assert corpus.buf[corpus.max_n:corpus.max_n + corpus.size].tolist() == held
    corpus.add(list(range(500)))  # longer than the whole corpus: not kept
    assert corpus.num_tokens <= 100


def test_the_corpus_finds_what_a_search_of_its_outputs_finds():
    """SuffixCorpus.matches against a search of every kept output: the longest suffix that
    occurs with a token after it, and its most recent MAX_OCCURRENCES occurrences (later
    outputs first), across adds and evictions; a match never spans two outputs."""
    from specserve.spec_decode.suffix import MAX_OCCURRENCES

    rng = random.Random(3)
    for max_n in (1, 3, 12):
        corpus = SuffixCorpus(1, max_n, max_tokens=400)
        for _ in range(40):
            corpus.add([rng.randrange(4) for _ in range(rng.randrange(2, 90))])
            assert corpus.num_tokens <= 400
            for _ in range(10):
                tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 20))]
                cap = min(max_n, len(tokens) - 1)
                expect = (0, [])
                for n in range(cap, 0, -1):
                    found = [(doc, p) for doc in reversed(corpus.docs)
                             for p in range(len(doc) - 1, n - 1, -1) if doc[p - n:p] == tokens[-n:]]
                    if found:
                        expect = (n, found[:MAX_OCCURRENCES])
                        break
                m, found = corpus.matches(tokens, cap)
                assert m == expect[0] and [(id(d), p) for d, p in found] == [(id(d), p) for d, p in expect[1]]


def test_an_output_drafts_for_the_next_request_at_once_whatever_its_length():
    proposer = SuffixProposer(8, 1, 6)
    long_output = random.Random(4).sample(range(10**6), 6000)  # every token once
    proposer.remember("r", long_output, None)
    context = [-5] + long_output[5000:5006]
    batch = ProposeBatch(["q"], [context], [4], -math.inf, [GREEDY], [0], [[]], [0], [None])
    assert proposer.propose(batch)[0].tokens == long_output[5006:5010]


@pytest.fixture(scope="module")
def suffix_llm(make_llm):
    # every drafted node verified: what the drafts are worth shows in the acceptance counts
    return make_llm(max_model_len=2048, speculative_config={
        "method": "suffix", "num_speculative_tokens": 8, "adaptive": False})


def test_greedy_equals_plain_decoding_and_the_corpus_pays(llm, suffix_llm):
    expect = greedy_baseline(llm)
    engine = suffix_llm.engine
    prompts = HIT_PROMPTS + MISS_PROMPTS
    outs = suffix_llm.generate(prompts, GREEDY)
    assert token_ids(outs) == [expect[p] for p in prompts]
    check_prefix_cache(engine, [o.prompt_token_ids + o.outputs[0].token_ids for o in outs])
    # a new question twice: the second answer is drafted from the first one's, and accepted
    question, params = "Tell me about the moon.", SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                 ignore_eos=True)
    plain = token_ids(llm.generate([question], params))
    assert token_ids(suffix_llm.generate([question], params)) == plain
    before = engine.stats.spec_num_accepted_tokens
    assert token_ids(suffix_llm.generate([question], params)) == plain
    assert engine.stats.spec_num_accepted_tokens - before >= MAX_TOKENS // 2


def test_through_the_server_each_api_key_is_a_tenant():
    """Two keys: what key A's requests wrote speeds up A's next request, never B's."""
    import httpx

    from tests.server_fixtures import ServerProcess

    server = ServerProcess(["--max-model-len", "512", "--api-key", "key-a", "--api-key", "key-b",
                            "--speculative-config",
                            '{"method": "suffix", "num_speculative_tokens": 8, "adaptive": false}'])
    try:
        def accepted(key: str) -> tuple[int, list]:
            r = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"prompt": "Tell me about the moon.", "max_tokens": 32,
                                 "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            body = r.json()
            return body["usage"]["speculation"]["num_accepted_tokens"], body["choices"][0]["text"]

        first_a, text = accepted("key-a")
        second_a, again = accepted("key-a")
        first_b, other = accepted("key-b")
        assert text == again == other  # lossless whoever drafts what
        assert second_a >= 16 and second_a > first_a
        assert first_b <= first_a  # B drafted from its own prompt only, as A did at first
    finally:
        server.stop()


def test_a_tree_method_takes_its_lookup_branch_from_suffix_decoding(llm, make_llm):
    """EAGLE with `"lookup": "suffix"`: the grafted branch is the suffix tree's first path (and
    learns across requests); greedy output stays plain decoding's."""
    from specserve.config import SpecConfig
    from specserve.spec_decode.suffix import SuffixProposer

    with pytest.raises(ValueError, match="lookup"):
        SpecConfig.parse({"method": "eagle", "lookup": "trie"})
    with pytest.raises(ValueError, match="applies to method"):
        SpecConfig.parse({"method": "ngram", "lookup": "suffix"})
    hybrid = make_llm(max_model_len=2048, speculative_config={"method": "eagle", "lookup": "suffix",
                                                              "adaptive": False})
    assert isinstance(hybrid.engine.spec.lookup, SuffixProposer)
    expect = greedy_baseline(llm)
    prompts = HIT_PROMPTS + MISS_PROMPTS
    assert token_ids(hybrid.generate(prompts, GREEDY)) == [expect[p] for p in prompts]
    assert hybrid.engine.spec.lookup.corpus(None).num_tokens > 0
