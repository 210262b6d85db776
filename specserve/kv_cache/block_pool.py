"""The pool of fixed-size KV blocks: free list, reference counts and the prefix-cache index.

Invariants:
  * every block is in exactly one of: held (ref_count > 0), the free list (ref 0, no hash),
    or the evictable LRU (ref 0, hashed, reusable by a later prefix hit);
  * a hashed block holds the K/V of exactly the tokens in its key and is never written again
    while hashed (writers only append into blocks they alone hold, past the cached ones);
  * `num_free` counts the free list and the evictable LRU: both can serve a new allocation.

A block's key is the 32-byte SHA-256 digest that chains its tokens to every block before it
(see KVCacheManager); the index maps digests to blocks and keeps nothing else per block.
"""

from __future__ import annotations

from collections import OrderedDict, deque

BlockKey = bytes  # SHA-256 over the previous block's key and this block's token ids


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 and hashed; oldest first
        self._key_of: dict[int, BlockKey] = {}
        self._block_of: dict[BlockKey, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    # -- allocation -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref 1); evicts least recently freed cached blocks when needed."""
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: want {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
            self.ref_count[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks found by a prefix hit."""
        for block in blocks:
            if self.ref_count[block] == 0:
                self._evictable.pop(block, None)
            self.ref_count[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference per block; pass them tail first so tails are evicted first."""
        for block in blocks:
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"block {block} released twice"
            if self.ref_count[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # -- prefix cache -------------------------------------------------------------------------
    def lookup(self, key: BlockKey) -> int | None:
        return self._block_of.get(key) if self.enable_prefix_caching else None

    def cache(self, block: int, key: BlockKey) -> bool:
        """Index a full block under its key; False if another block already holds that key."""
        if not self.enable_prefix_caching or key in self._block_of or block in self._key_of:
            return False
        self._key_of[block] = key
        self._block_of[key] = block
        return True

    def _uncache(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            self._block_of.pop(key, None)

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def key_of(self, block: int) -> BlockKey | None:
        """The key a cached block is indexed under, None if it is not in the prefix cache."""
        return self._key_of.get(block)

    def reset_prefix_cache(self) -> None:
        """Every evictable block back to the free list, out of the index; held blocks keep their keys."""
        for block in list(self._evictable):
            self._uncache(block)
            self._free.append(block)
        self._evictable.clear()
