"""The KV cache's blocks, as the scheduler owns them: which block holds which request's tokens,
and which full blocks hold what content, for any request whose prompt starts the same way.

The workers keep each layer's keys and values as a pool of fixed-size blocks
([kv_heads, num_blocks, block_size, head_dim]: ``kernels.cache_attention`` reads a row's blocks
through its block table); this module decides the tables. A request's table
(:class:`BlockTable`) lists its blocks in position order: position ``p`` is in block
``table[p // block_size]`` at ``p % block_size``.

Sharing (vLLM's automatic prefix caching): a block whose every position holds a final token
(a prompt token, or an output token verified and kept) is *full*; it gets a key, the hash of its
tokens chained with its predecessor's key, so equal keys mean the same tokens from position 0
on, hence the same keys and values. A full block is never written again. A new request maps the
longest run of cached full blocks its prompt starts with (:meth:`BlockPool.match_prefix`) and
computes only the rest. Blocks count their users; one that no request holds keeps its content
and its key, *evictable*, until an allocation needs it (least recently released first).

Not here: when to allocate, preempt or wait (the scheduler's batching), and the keys' and
values' bytes (the workers).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice

import numpy as np


def block_key(parent: bytes | None, tokens: Sequence[int] | np.ndarray) -> bytes:
    """The key of a full block holding ``tokens`` after the block whose key is ``parent`` (None:
    the first block): 16 bytes of BLAKE2b, so two different prefixes share a key with odds of
    about 2^-64 at a billion blocks."""
    digest = hashlib.blake2b(digest_size=16)
    if parent is not None:
        digest.update(parent)
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.digest()


def prefix_keys(tokens: Sequence[int] | np.ndarray, block_size: int) -> Iterator[bytes]:
    """The keys of the full blocks of ``tokens``, in order (each chained to the one before)."""
    parent: bytes | None = None
    for i in range(len(tokens) // block_size):
        parent = block_key(parent, tokens[i * block_size : (i + 1) * block_size])
        yield parent


class NoFreeBlocks(Exception):
    """An allocation that the pool cannot serve, even by evicting every cached block."""


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` positions: free, held by requests (a count of
    holders each), or cached (full, keyed, held by none: evicted least recently released first)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs blocks and positions, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self.keys: list[bytes | None] = [None] * num_blocks
        self.by_key: dict[bytes, int] = {}
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # held by none, keyed: LRU first
        self.num_evicted = 0
        self.high_water = 0  # blocks below this one have been written (free ones are taken lowest first)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free ones and cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self.by_key)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for one holder, free ones first, then the least recently released cached
        ones (their content forgotten). Raises NoFreeBlocks, taking none, if there are not ``n``."""
        if n > self.num_free:
            raise NoFreeBlocks(f"{n} blocks wanted, {self.num_free} free")
        taken = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
                self.num_evicted += 1
            self.ref_counts[block] = 1
            self.high_water = max(self.high_water, block + 1)
            taken.append(block)
        return taken

    def release(self, blocks: Sequence[int]) -> None:
        """One holder lets go of ``blocks``. A block no one holds is free again, or, full and
        keyed, cached (evicted last among those released earlier). Later blocks of a table are
        released first, so a prefix's first blocks outlive its last ones."""
        for block in reversed(blocks):
            if self.ref_counts[block] <= 0:
                raise ValueError(f"block {block} released more often than it was held")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.keys[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None

    def commit(self, block: int, key: bytes) -> int:
        """``block``, now full, holds the content ``key`` names. Returns the block that holds it
        from now on: ``block``, or an older block with that key (two requests computed the same
        tokens at once); the caller then holds the older one instead, and ``block`` is released."""
        if self.keys[block] is not None:
            if self.keys[block] != key:
                raise ValueError(f"block {block} is full already, with other content")
            return block
        older = self.by_key.get(key)
        if older is None:
            self.keys[block] = key
            self.by_key[key] = block
            return block
        self._hold(older)
        self.release([block])
        return older

    def match_prefix(
        self, tokens: Sequence[int] | np.ndarray, max_blocks: int | None = None, keys: Iterable[bytes] | None = None
    ) -> list[int]:
        """The cached full blocks that ``tokens`` start with, in order, each now held once more
        by the caller (at most ``max_blocks``). ``keys``: the tokens' full blocks' keys where the
        caller has them (:func:`prefix_keys`), else they are computed until the first miss."""
        found: list[int] = []
        size = self.block_size
        limit = len(tokens) // size if max_blocks is None else min(max_blocks, len(tokens) // size)
        for key in islice(keys if keys is not None else prefix_keys(tokens, size), limit):
            block = self.by_key.get(key)
            if block is None:
                break
            self._hold(block)
            found.append(block)
        return found

    def _hold(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self._evictable.pop(block, None)
        self.ref_counts[block] += 1

    def _forget(self, block: int) -> None:
        key = self.keys[block]
        if key is not None:
            self.keys[block] = None
            if self.by_key.get(key) == block:
                del self.by_key[key]


class BlockTable:
    """One request's blocks in position order, and the keys of those that are full: what it holds
    in the pool. ``num_full`` blocks are committed (their tokens final, their content shared)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self.num_full = 0
        self._last_key: bytes | None = None
        self.changed = False  # since the workers were last sent the table (Batcher.table_updates)

    @property
    def capacity(self) -> int:
        """Positions the table's blocks hold."""
        return len(self.blocks) * self.pool.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks to allocate before positions up to ``num_tokens`` can be written."""
        return max(0, -(-num_tokens // self.pool.block_size) - len(self.blocks))

    def map_prefix(self, tokens: Sequence[int] | np.ndarray, keys: Iterable[bytes] | None = None) -> int:
        """For a table with no blocks yet: map the cached blocks ``tokens`` start with (``keys``:
        their full blocks' keys, where the caller has them); returns how many tokens they hold
        (their keys and values need no computing). At least one token is left to compute: a
        forward needs a new token to give logits."""
        if self.blocks:
            raise ValueError("a prefix is mapped into an empty table only")
        found = self.pool.match_prefix(tokens, (len(tokens) - 1) // self.pool.block_size, keys)
        self.blocks = list(found)
        self.num_full = len(found)
        self.changed = True
        if found:
            self._last_key = self.pool.keys[found[-1]]
        return len(found) * self.pool.block_size

    def grow(self, num_tokens: int) -> None:
        """Allocate blocks until positions up to ``num_tokens`` fit. Raises NoFreeBlocks (and
        allocates nothing) where the pool has too few."""
        needed = self.blocks_needed(num_tokens)
        if needed:
            self.blocks += self.pool.allocate(needed)
            self.changed = True

    def commit(self, tokens: Sequence[int] | np.ndarray, num_final: int) -> None:
        """The first ``num_final`` of ``tokens`` (the request's whole sequence) are final: every
        block they fill is full from now on, keyed and shared. A block computed twice at once
        (another request committed the same content first) is swapped for the older one."""
        size = self.pool.block_size
        while self.num_full < min(num_final // size, len(self.blocks)):
            i = self.num_full
            key = block_key(self._last_key, tokens[i * size : (i + 1) * size])
            held = self.pool.commit(self.blocks[i], key)
            if held != self.blocks[i]:
                self.blocks[i], self.changed = held, True
            self._last_key = key
            self.num_full += 1

    def truncate(self, num_tokens: int) -> None:
        """Keep only the blocks positions below ``num_tokens`` need (rejected drafts rolled back);
        full blocks are never dropped this way (their tokens are final)."""
        keep = max(self.num_full, -(-num_tokens // self.pool.block_size))
        if keep < len(self.blocks):
            self.pool.release(self.blocks[keep:])
            del self.blocks[keep:]
            self.changed = True

    def release(self) -> None:
        """Let go of every block (the request finished, failed or was preempted)."""
        self.pool.release(self.blocks)
        self.blocks, self.num_full, self._last_key = [], 0, None
        self.changed = True
