"""KV block accounting (pure Python): which blocks a sequence owns, and the prefix cache.

Blocks are reference counted.  Rolling back rejected draft positions is
bookkeeping only: the sequence's token count shrinks and blocks beyond it return
to the free list; their stale contents are overwritten by the next write to
those slots.

Automatic prefix caching (``enable_caching``)
---------------------------------------------
A FULL block whose K/V is computed is registered under the hash chain of its
tokens: ``h_i = hash((h_{i-1}, tokens of block i))``, so a hash names the block's
tokens AND everything before them (the K/V of a token depends on its prefix).
The chain starts from the request's cache partition (``h_{-1}`` = its
``cache_salt``, set per tenant by the server), so tenants never share blocks.
The exact key ``(h_{i-1}, tokens)`` is kept too and compared on every lookup, so
a hash collision can never hand out the wrong K/V.  A registered block whose
last reference is released stays cached: it joins an LRU list of free-but-cached
blocks, still counted as free (vLLM's accounting), and is evicted (unregistered)
only when an allocation finds no never-cached free block.  ``match`` returns the
longest cached chain of a token prefix; ``acquire`` takes a reference on each
(ref counts > 1 = shared).  Shared blocks are only ever full prompt/output
blocks below a sequence's computed length, which trim never releases and no
write touches (writes start at ``num_computed``), so no copy-on-write is needed.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


def chain_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int, parent: int | None = None,
                 start: int = 0, salt: str | None = None) -> list[tuple[int, tuple]]:  # fmt: skip
    """(hash, key) of full blocks ``start .. num_blocks-1`` of ``token_ids``; ``parent`` is the
    hash of block ``start - 1`` (ignored for the first block).  ``salt`` (the request's cache
    partition, ``SamplingParams.cache_salt``) is the first block's parent: equal tokens under
    different salts never share a hash nor a key, so no block crosses partitions."""
    out = []
    h: int | str | None = salt if start == 0 else parent
    for i in range(start, num_blocks):
        key = (h, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        h = hash(key)
        out.append((h, key))
    return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))  # never cached (or evicted)
        self._ref = [0] * num_blocks
        # Prefix cache: block -> (hash, key), hash -> block, and free blocks still cached (LRU first).
        self._block_key: dict[int, tuple[int, tuple]] = {}
        self._by_hash: dict[int, int] = {}
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self.num_queried_tokens = 0  # prefix-cache lookups and hits, in tokens (vLLM's unit)
        self.num_hit_tokens = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: never-cached ones plus cached ones nobody uses."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (in use or not)."""
        return len(self._block_key)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (the kv_cache_usage_perc gauge)."""
        return 1.0 - self.num_free / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    # ------------------------------------------------------------------ prefix cache
    def match(self, hashes: Sequence[tuple[int, tuple]]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (from ``chain_hashes``)."""
        out = []
        for h, key in hashes:
            b = self._by_hash.get(h)
            if b is None or self._block_key[b][1] != key:
                break
            out.append(b)
        return out

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference on each cached block (``match``'s result) for a new owner."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._cached_free[b]
            self._ref[b] += 1

    def register(self, block: int, h: int, key: tuple) -> None:
        """Record that ``block`` (owned, full, computed) holds the tokens named by ``h``.
        A hash already cached in another block keeps that one."""
        if not self.enable_caching or block in self._block_key or h in self._by_hash:
            return
        self._block_key[block] = (h, key)
        self._by_hash[h] = block

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        b, _ = self._cached_free.popitem(last=False)  # evict the least recently used
        h, _ = self._block_key.pop(b)
        del self._by_hash[h]
        return b

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_fit(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(table) <= self.num_free

    def ensure(self, table: list[int], num_tokens: int) -> bool:
        """Grow `table` in place to hold `num_tokens`; False (unchanged) if blocks are short."""
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            b = self._take()
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
            if b in self._block_key:
                self._cached_free[b] = None  # most recently used end
            else:
                self._free.append(b)
