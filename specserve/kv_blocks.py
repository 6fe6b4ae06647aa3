"""KV block accounting (pure Python): which blocks a sequence owns.

Blocks are reference counted so that a block may one day be shared (prefix
caching); today each sequence owns its blocks.  Rolling back rejected draft
positions is bookkeeping only: the sequence's token count shrinks and blocks
beyond it return to the free list; their stale contents are overwritten by the
next write to those slots.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (the kv_cache_usage_perc gauge)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_fit(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(table) <= len(self._free)

    def ensure(self, table: list[int], num_tokens: int) -> bool:
        """Grow `table` in place to hold `num_tokens`; False (unchanged) if blocks are short."""
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            b = self._free.popleft()
            self._ref[b] = 1
            table.append(b)
        return True

    def trim(self, table: list[int], num_tokens: int) -> None:
        """Release blocks of `table` beyond those needed for `num_tokens` (rollback)."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, table: list[int]) -> None:
        while table:
            self._release(table.pop())

    def _release(self, b: int) -> None:
        assert self._ref[b] > 0, f"double free of KV block {b}"
        self._ref[b] -= 1
        if self._ref[b] == 0:
            self._free.append(b)
