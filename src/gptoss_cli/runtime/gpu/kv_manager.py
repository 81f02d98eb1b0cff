"""Which KV blocks each sequence holds, in both pools (full and sliding layers), with prefix caching.

Pure Python over two BlockPools; the device tensors live in kv_cache.py. Invariants:
- a running sequence holds a full-pool block for every logical block it has computed or is
  about to compute, and a sliding-pool block for every logical block a current or future query
  can see (the last `window` positions before the next token);
- a block completely filled with computed tokens is registered under the chain hash of the
  tokens up to its end, in both pools, so identical prefixes are shared and, once released,
  stay cached until evicted;
- a prefix hit needs the full blocks of the whole prefix *and* the sliding blocks of the last
  window before its end; the longest prefix with both is reused.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_pool import BlockPool, chain_hash
from .sequence import Sequence


@dataclass
class BlockUpdate:
    """One block-table entry that changed: table[row, logical] = block."""

    pool: str  # "full" | "slide"
    row: int
    logical: int
    block: int


class KvManager:
    def __init__(self, full_blocks: int, slide_blocks: int, block_size: int, window: int):
        self.full = BlockPool(full_blocks)
        self.slide = BlockPool(slide_blocks)
        self.block_size = block_size
        self.window = window
        self.updates: list[BlockUpdate] = []  # drained by the runner before each forward

    def drop_prefix_cache(self) -> None:
        """Forget the cached prefixes no running sequence uses (after the engine's warm-up)."""
        self.full.drop_cached()
        self.slide.drop_cached()

    # ---- sizes -------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_visible_block(self, next_position: int) -> int:
        """Lowest logical block a query at `next_position` (or later) can still see."""
        return max(0, next_position - self.window + 1) // self.block_size

    def _inside_block(self, seq: Sequence, n: int) -> bool:
        """The next n tokens fall in the block already holding position num_computed - 1: no new
        block in either pool (that block is allocated and, holding the newest key, visible)."""
        return seq.num_computed % self.block_size != 0 and (seq.num_computed % self.block_size) + n <= self.block_size

    def step_cost(self, seq: Sequence, n: int) -> tuple[int, int]:
        """New (full, sliding) blocks needed to compute the next n tokens of seq."""
        if self._inside_block(seq, n):  # the common decode step, without the scan below
            return 0, 0
        end_block = self.blocks_for(seq.num_computed + n)
        new_full = max(0, end_block - len(seq.full_blocks))
        first = self.first_visible_block(seq.num_computed)
        new_slide = sum(1 for j in range(first, end_block) if j >= len(seq.slide_blocks) or not seq.slide_blocks[j])
        return new_full, new_slide

    def can_run(self, cost: tuple[int, int]) -> bool:
        # A zero cost (most decode steps) needs no look at the pools.
        return (not cost[0] or self.full.can_allocate(cost[0])) and (not cost[1] or self.slide.can_allocate(cost[1]))

    # ---- prefix cache --------------------------------------------------------------------
    def prefix_hashes(self, tokens: list[int]) -> list[bytes]:
        """Chain hashes of the full blocks a prompt may reuse (it must keep >= 1 token to run)."""
        out, parent = [], None
        for j in range((len(tokens) - 1) // self.block_size):
            parent = chain_hash(parent, tokens[j * self.block_size:(j + 1) * self.block_size])
            out.append(parent)
        return out

    def longest_hit(self, hashes: list[bytes]) -> int:
        """Number of leading blocks reusable from both pools."""
        k = 0
        while k < len(hashes) and self.full.lookup(hashes[k]) is not None:
            k += 1
        while k > 0:
            first = self.first_visible_block(k * self.block_size)
            if all(self.slide.lookup(h) is not None for h in hashes[first:k]):
                return k
            k -= 1
        return 0

    def attach_prefix(self, seq: Sequence) -> int:
        """Share the longest cached prefix with a newly admitted sequence; returns its tokens."""
        hashes = self.prefix_hashes(seq.tokens)
        k = self.longest_hit(hashes)
        first = self.first_visible_block(k * self.block_size)
        for j in range(k):
            block = self.full.lookup(hashes[j])
            self.full.share(block)
            seq.full_blocks.append(block)
            self._table(seq, "full", j, block)
            if j >= first:
                block = self.slide.lookup(hashes[j])
                self.slide.share(block)
                seq.slide_blocks.append(block)
                self._table(seq, "slide", j, block)
            else:
                seq.slide_blocks.append(0)
        seq.hashes = hashes[:k]
        seq.num_computed = k * self.block_size
        seq.slide_start = first if k else 0
        return seq.num_computed

    # ---- per step --------------------------------------------------------------------------
    def reserve(self, seq: Sequence, n: int) -> None:
        """Make room for tokens [num_computed, num_computed + n); call after can_run()."""
        self._release_invisible(seq)
        if self._inside_block(seq, n):
            return
        end_block = self.blocks_for(seq.num_computed + n)
        while len(seq.full_blocks) < end_block:
            block = self.full.allocate()
            self._table(seq, "full", len(seq.full_blocks), block)
            seq.full_blocks.append(block)
        first = self.first_visible_block(seq.num_computed)
        while len(seq.slide_blocks) < end_block:
            seq.slide_blocks.append(0)
        for j in range(first, end_block):
            if not seq.slide_blocks[j]:
                seq.slide_blocks[j] = self.slide.allocate()
                self._table(seq, "slide", j, seq.slide_blocks[j])

    def computed(self, seq: Sequence, n: int) -> None:
        """Record that n more tokens have KV; register blocks that became full."""
        seq.num_computed += n
        full_now = seq.num_computed // self.block_size
        while len(seq.hashes) < full_now:
            j = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else None
            h = chain_hash(parent, seq.tokens[j * self.block_size:(j + 1) * self.block_size])
            seq.hashes.append(h)
            self.full.register(seq.full_blocks[j], h)
            if seq.slide_blocks[j]:
                self.slide.register(seq.slide_blocks[j], h)

    def free(self, seq: Sequence) -> None:
        """Release everything a sequence holds (finish, abort or preemption)."""
        for block in seq.full_blocks:
            self.full.release(block)
        for block in seq.slide_blocks:
            if block:
                self.slide.release(block)
        seq.full_blocks, seq.slide_blocks, seq.hashes = [], [], []
        seq.num_computed = seq.slide_start = 0

    def _release_invisible(self, seq: Sequence) -> None:
        first = min(self.first_visible_block(seq.num_computed), len(seq.slide_blocks))
        if first <= seq.slide_start:
            return
        for j in range(seq.slide_start, first):
            if seq.slide_blocks[j]:
                self.slide.release(seq.slide_blocks[j])
                seq.slide_blocks[j] = 0
        seq.slide_start = max(seq.slide_start, first)

    def _table(self, seq: Sequence, pool: str, logical: int, block: int) -> None:
        if seq.row >= 0:
            self.updates.append(BlockUpdate(pool, seq.row, logical, block))
