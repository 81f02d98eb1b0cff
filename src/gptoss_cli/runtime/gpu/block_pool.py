"""Block bookkeeping for one paged KV pool: free list, reference counts, prefix-cache hashes.

Pure Python (no torch), so it is tested on the CPU. A block holding a full run of BLOCK_SIZE
tokens may carry a hash of (parent hash, its tokens); when its last user releases it, it stays
cached (evictable, LRU) and a later sequence with the same prefix can take it back. Block 0 is
reserved as a scratch target for padded rows of CUDA graphs and is never handed out.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict


def chain_hash(parent: bytes | None, tokens: list[int] | tuple[int, ...]) -> bytes:
    """Identity of a full block: all tokens before it (through the parent) plus its own."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


class BlockPool:
    """Allocator for `num_blocks` blocks (ids 1..num_blocks-1 usable)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (block 0 is scratch)")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0, LRU order

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self) -> int:
        """A fresh block with refcount 1 (evicts the least recently used cached block if needed)."""
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._forget_hash(block)
        else:
            raise MemoryError("KV block pool exhausted")
        self._refs[block] = 1
        return block

    def release(self, block: int) -> None:
        """Drop one reference; at zero the block becomes evictable (if hashed) or free."""
        if block == 0 or self._refs[block] <= 0:
            raise ValueError(f"release of block {block} that is not held")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def share(self, block: int) -> None:
        """Take another reference to a held or cached block."""
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    # ---- prefix cache ----------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash)

    def register(self, block: int, block_hash: bytes) -> None:
        """Mark a held block as holding the full block identified by `block_hash`."""
        if block in self._hash_of or block_hash in self._by_hash:
            return  # already cached (another sequence computed the same block first)
        self._hash_of[block] = block_hash
        self._by_hash[block_hash] = block

    def drop_cached(self) -> None:
        """Forget every cached block that no sequence holds; they become plain free blocks."""
        for block in self._evictable:
            self._forget_hash(block)
            self._free.append(block)
        self._evictable.clear()

    def _forget_hash(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            self._by_hash.pop(h, None)

    def refcount(self, block: int) -> int:
        return self._refs[block]
