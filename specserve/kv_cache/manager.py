"""Per-request block tables over the BlockPool: allocate, prefix hits, truncate, free.

A request's `block_ids` cover its first `num_computed_tokens` positions plus whatever slots
were reserved for the tokens scheduled this step (prompt chunk, decode token, drafts).
Full blocks whose tokens are all committed (prompt or accepted output, never drafts) get a
chained key (previous block's hash, this block's tokens) and enter the prefix cache, so a
block holding a rejected draft token can never be found by a later request.
"""

from __future__ import annotations

from specserve.kv_cache.block_pool import BlockKey, BlockPool
from specserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)

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
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hits: list[int] = []
        parent = 0
        for i in range(max_blocks):
            key: BlockKey = (parent, tuple(req.all_token_ids[i * bs:(i + 1) * bs]))
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
            parent = hash(key)
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
            self._rebuild_hashes(req, len(hits))
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
    def cache_committed_blocks(self, req: Request) -> None:
        """Index every full block whose tokens are computed and committed."""
        bs = self.block_size
        num_full = min(req.num_computed_tokens, req.num_tokens) // bs
        num_full = min(num_full, len(req.block_ids))
        self._rebuild_hashes(req, num_full, cache=True)

    def _rebuild_hashes(self, req: Request, upto: int, cache: bool = False) -> None:
        bs = self.block_size
        parent = req.block_hashes[-1] if req.block_hashes else 0
        for i in range(len(req.block_hashes), upto):
            key: BlockKey = (parent, tuple(req.all_token_ids[i * bs:(i + 1) * bs]))
            if cache:
                self.pool.cache(req.block_ids[i], key)
            parent = hash(key)
            req.block_hashes.append(parent)
