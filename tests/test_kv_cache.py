"""Block pool, prefix cache and truncate, without a model."""

import pytest

from specserve.kv_cache.block_pool import BlockPool
from specserve.kv_cache.manager import KVCacheManager
from specserve.request import Request, SamplingParams


def _req(tokens, rid="r"):
    return Request(rid, tokens, SamplingParams(max_tokens=4), {2}, sampling_seed=0)


def test_pool_refcounts_and_free_list():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and all(pool.ref_count[b] == 1 for b in a)
    pool.touch(a[:1])
    pool.release(a)
    assert pool.num_free == 3 and pool.ref_count[a[0]] == 1
    pool.release(a[:1])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_prefix_hit_chains_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = _req(list(range(10)), "a")
    kv.allocate(first, 10)
    first.num_computed_tokens = 10
    kv.cache_committed_blocks(first)
    assert len(first.block_hashes) == 2  # the partial third block is not cached
    kv.free(first)
    assert kv.num_free_blocks == 16  # cached blocks count as free (evictable)

    same = _req(list(range(10)), "b")
    hits = kv.find_cached_prefix(same)
    assert len(hits) == 2
    kv.allocate(same, 10, hits)
    assert same.num_computed_tokens == 8 and same.num_cached_tokens == 8
    kv.free(same)

    exact = _req(list(range(8)), "c")  # fully cached prompt: the last block is recomputed
    assert len(kv.find_cached_prefix(exact)) == 1
    other = _req([0, 1, 2, 3, 9, 9, 9, 9, 9], "d")  # diverges in block 2
    assert len(kv.find_cached_prefix(other)) == 1


def test_lru_eviction_reuses_cached_blocks():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = _req(list(range(8)), "a")
    kv.allocate(r, 8)
    r.num_computed_tokens = 8
    kv.cache_committed_blocks(r)
    kv.free(r)
    assert kv.pool.num_cached == 2
    s = _req([7] * 8, "b")
    kv.allocate(s, 8)  # evicts both cached blocks
    assert kv.pool.num_cached == 0
    kv.free(s)


def test_truncate_frees_whole_blocks_only():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = _req(list(range(5)), "a")
    kv.allocate(r, 5 + 6)  # prompt + 6 reserved draft slots -> 3 blocks
    r.num_computed_tokens = 11
    assert len(r.block_ids) == 3
    assert kv.truncate(r, 6) == 6
    assert len(r.block_ids) == 2 and kv.num_free_blocks == 6
    assert kv.truncate(r, 4) == 4 and len(r.block_ids) == 1
    kv.free(r)
    assert kv.num_free_blocks == 8


def test_truncate_never_reopens_a_cached_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = _req(list(range(8)), "a")
    kv.allocate(r, 8)
    r.num_computed_tokens = 8
    kv.cache_committed_blocks(r)
    # rolling back into the cached second block drops it and recomputes from its start
    assert kv.truncate(r, 6) == 4
    assert len(r.block_ids) == 1
    kv.free(r)
    assert kv.num_free_blocks == 8


def test_can_allocate_counts_prefix_hits_once():
    """Admission with prefix hits under a tight pool (found by a preemption run in test_spec_draft_model)."""
    kv = KVCacheManager(4, 4)
    req = _req(list(range(13)), "a")
    kv.allocate(req, 13)
    req.num_computed_tokens = 13
    kv.cache_committed_blocks(req)
    kv.free(req)
    again = _req(list(range(13)), "b")
    hits = kv.find_cached_prefix(again)
    assert len(hits) == 3
    assert kv.can_allocate(again, 13, hits)  # 3 hit blocks + 1 new block, 4 in the pool
    assert not kv.can_allocate(again, 17, hits)  # would need 2 new blocks
    # headroom: blocks kept free for the running requests' next tokens
    assert kv.can_allocate(again, 13, hits, headroom=0)
    assert not kv.can_allocate(again, 13, hits, headroom=1)
