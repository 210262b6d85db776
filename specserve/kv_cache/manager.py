"""Per-request block tables over the BlockPool: allocate, prefix hits, truncate, free.

A request's `block_ids` cover its first `num_computed_tokens` positions plus whatever slots
were reserved for the tokens scheduled this step (prompt chunk, decode token, drafts).
Full blocks whose tokens are all committed (prompt or accepted output, never drafts) get a
key and enter the prefix cache, so a block holding a rejected draft token can never be found
by a later request.

A block's key is SHA-256 over the previous block's key (ROOT_KEY for the first block) and
this block's token ids packed as little-endian int64: a fixed-width encoding, so two token
lists never serialise alike, and a chain, so equal keys mean equal whole prefixes. Unlike
Python's hash() of a tuple (64 bits, the same function in every process), finding two
prefixes with the same key is out of reach, so one tenant's prompt cannot be made to hit
another's KV. `req.block_hashes` lists the keys of the request's hashed blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from specserve.kv_cache.block_pool import BlockKey, BlockPool
from specserve.request import Request

ROOT_KEY: BlockKey = hashlib.sha256(b"specserve prefix cache root").digest()  # first block's parent
_sha256 = hashlib.sha256


def block_keys(token_ids: Sequence[int], block_size: int, parent: BlockKey = ROOT_KEY) -> list[BlockKey]:
    """Chained keys of the full blocks of token_ids, the first one's parent being `parent`."""
    n = len(token_ids) // block_size
    if n == 0:
        return []
    data = struct.pack(f"<{n * block_size}q", *token_ids[:n * block_size])
    step = 8 * block_size
    keys = []
    for start in range(0, len(data), step):
        parent = _sha256(parent + data[start:start + step]).digest()
        keys.append(parent)
    return keys


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._pack_block = struct.Struct(f"<{block_size}q").pack  # one block's token ids

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    # -- prefix hits ----------------------------------------------------------------------
    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks already holding a prefix of the request's committed tokens.

        At least one token is always left to compute, since the step needs its logits.
        """
        if not self.pool.enable_prefix_caching:
            return []
        bs = self.block_size
        tokens, pack, lookup = req.all_token_ids, self._pack_block, self.pool.lookup
        hits: list[int] = []
        key = ROOT_KEY
        for start in range(0, (req.num_tokens - 1) // bs * bs, bs):  # hashed one block at a time:
            key = _sha256(key + pack(*tokens[start:start + bs])).digest()  # stops at the first miss
            block = lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    # -- allocation -----------------------------------------------------------------------
    def blocks_needed(self, req: Request, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        total = req.num_computed_tokens + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(req.block_ids) - num_hit_blocks)

    def can_allocate(self, req: Request, num_new_tokens: int, hits: list[int] = (),
                     headroom: int = 0) -> bool:
        """True if the slots fit and `headroom` blocks stay free afterwards."""
        # touching an evictable hit removes it from the free count
        hit_from_free = sum(1 for b in hits if self.pool.ref_count[b] == 0)
        needed = self.blocks_needed(req, num_new_tokens, len(hits))  # num_new counts the hits
        return needed + hit_from_free + headroom <= self.pool.num_free

    def allocate(self, req: Request, num_new_tokens: int, hits: list[int] = ()) -> None:
        """Reserve slots for num_new_tokens past the computed ones (after prefix hits)."""
        if hits:
            assert not req.block_ids and req.num_computed_tokens == 0
            self.pool.touch(list(hits))
            req.block_ids = list(hits)
            req.num_computed_tokens = len(hits) * self.block_size
            req.num_cached_tokens = req.num_computed_tokens
            num_new_tokens -= req.num_computed_tokens
            req.block_hashes = [self.pool.key_of(b) for b in hits]  # the keys that found them
            assert None not in req.block_hashes, "a prefix hit left the cache before allocate"
        req.block_ids += self.pool.allocate(self.blocks_needed(req, num_new_tokens))

    def try_allocate(self, req: Request, num_new_tokens: int) -> bool:
        """allocate() when the slots fit (a draft model's next verify slots); False otherwise."""
        if ok := self.can_allocate(req, num_new_tokens):
            self.allocate(req, num_new_tokens)
        return ok

    def free(self, req: Request) -> None:
        self.pool.release(req.block_ids[::-1])
        req.block_ids = []
        req.block_hashes = []
        req.num_computed_tokens = 0

    def truncate(self, req: Request, length: int) -> int:
        """Roll the request back to `length` computed tokens, freeing whole blocks past it.

        Returns the new computed length. It is `length` unless the block that would become
        partial is in the prefix cache (shared or indexed, so it must not be written again);
        then that block is dropped too and the computed length falls to its start.
        """
        bs = self.block_size
        keep = cdiv(length, bs)
        if length % bs and keep <= len(req.block_hashes):
            keep -= 1
            length = keep * bs
        self.pool.release(req.block_ids[keep:][::-1])
        del req.block_ids[keep:]
        del req.block_hashes[keep:]
        req.num_computed_tokens = min(req.num_computed_tokens, length)
        return req.num_computed_tokens

    # -- prefix cache -------------------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds (held ones stay indexed)."""
        self.pool.reset_prefix_cache()

    def cache_committed_blocks(self, req: Request) -> None:
        """Key and index every full block whose tokens are computed and committed."""
        bs, done = self.block_size, len(req.block_hashes)
        num_full = min(req.num_computed_tokens, req.num_tokens) // bs
        num_full = min(num_full, len(req.block_ids))
        if num_full <= done:
            return
        parent = req.block_hashes[-1] if done else ROOT_KEY
        keys = block_keys(req.all_token_ids[done * bs:num_full * bs], bs, parent)
        for block, key in zip(req.block_ids[done:num_full], keys):
            self.pool.cache(block, key)
        req.block_hashes += keys
