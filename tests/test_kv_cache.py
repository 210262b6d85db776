"""Block pool, prefix cache (SHA-256 block keys) and truncate, without a model."""

import hashlib
import struct

import pytest

from specserve.kv_cache.block_pool import BlockPool
from specserve.kv_cache.manager import ROOT_KEY, KVCacheManager, block_keys
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


def _cached(tokens, block_size=4, num_blocks=16):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    r = _req(tokens)
    kv.allocate(r, len(tokens))
    r.num_computed_tokens = len(tokens)
    kv.cache_committed_blocks(r)
    return kv, r


def test_block_keys_are_chained_sha256_digests():
    tokens = [5, 1 << 40, 0, 7, 151_000, 3, 3, 3, 9]
    kv, r = _cached(tokens)
    k0 = hashlib.sha256(ROOT_KEY + struct.pack("<4q", *tokens[:4])).digest()
    k1 = hashlib.sha256(k0 + struct.pack("<4q", *tokens[4:8])).digest()
    assert r.block_hashes == [k0, k1] == block_keys(tokens, 4)
    assert len(ROOT_KEY) == 32
    assert ROOT_KEY == hashlib.sha256(b"specserve prefix cache root").digest()  # same in every process
    # the index holds the digests themselves, nothing else
    assert set(kv.pool._block_of) == {k0, k1}
    assert all(type(k) is bytes and len(k) == 32 for k in kv.pool._key_of.values())
    assert kv.pool.key_of(r.block_ids[1]) == k1 and kv.pool.key_of(r.block_ids[2]) is None
    kv.free(r)


def test_block_keys_depend_on_the_whole_prefix_and_exact_tokens():
    bs = 4
    same_tail_other_head = block_keys([1, 2, 3, 4, 9, 9, 9, 9], bs)
    base = block_keys([1, 2, 3, 5, 9, 9, 9, 9], bs)
    assert same_tail_other_head[1] != base[1]  # equal block, different parent
    # fixed-width packing: lists that a variable-width or text encoding could confuse
    variants = ([1, 23, 4, 5], [12, 3, 4, 5], [256, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0],
                [1 << 32, 0, 0, 0])
    assert len({block_keys(v, bs)[0] for v in variants}) == len(set(map(tuple, variants)))


def test_incremental_keys_match_keying_all_at_once():
    tokens = list(range(100, 123))
    kv = KVCacheManager(num_blocks=16, block_size=4)
    r = _req(tokens[:6])
    kv.allocate(r, 6)
    r.num_computed_tokens = 6
    kv.cache_committed_blocks(r)
    assert len(r.block_hashes) == 1
    for t in tokens[6:]:  # decode one token at a time
        r.all_token_ids.append(t)
        kv.allocate(r, 1)
        r.num_computed_tokens += 1
        kv.cache_committed_blocks(r)
    assert r.block_hashes == block_keys(tokens, 4) and len(r.block_hashes) == 5
    kv.free(r)

    again = _req(tokens + [1])
    hits = kv.find_cached_prefix(again)
    assert hits and len(hits) == 5
    kv.allocate(again, len(tokens) + 1, hits)
    assert again.block_hashes == block_keys(tokens, 4)  # taken from the index, not recomputed
    kv.free(again)
    assert kv.num_free_blocks == 16


def test_prefix_caching_disabled_finds_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    r = _req(list(range(9)))
    kv.allocate(r, 9)
    r.num_computed_tokens = 9
    kv.cache_committed_blocks(r)
    assert kv.pool.num_cached == 0 and len(r.block_hashes) == 2  # keyed: never rewritten
    kv.free(r)
    assert kv.find_cached_prefix(_req(list(range(9)), "b")) == []
