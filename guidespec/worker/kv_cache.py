"""The key/value cache, in blocks: one [num_blocks, kv_heads, block_size, head_dim] pair per layer.

A slot belongs to one request for its whole life and owns ``blocks_per_slot`` consecutive
blocks: a request's keys at position p live in block ``slot * blocks_per_slot + p //
block_size`` at ``p % block_size``. With the default block size (``max_len``: one block a slot)
that is the cache by slot, [slots, kv_heads, max_len, head_dim]. Rewinding a request (rejected
drafts) needs no work here: the scheduler lowers its computed length and later writes overwrite
the stale positions.

Everything that reads or writes the cache goes through a row's block table (:meth:`block_tables`)
or a token's cache row (:meth:`cache_rows`, block * block_size + offset): the CPU kernels
(``kernels.cache_attention``), and here the torch paths (:meth:`write`, :meth:`gather`). The block
size is ``GUIDESPEC_KV_BLOCK_SIZE`` where set (a multiple of 8); the scheduler's paged tables
(``scheduler/kv_blocks.py``, issue 47) are the next step.
"""

from __future__ import annotations

import math

import numpy as np
import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str = "cpu",
        block_size: int | None = None,
    ) -> None:
        block_size = block_size or max_len
        if block_size != max_len and block_size % 8:
            raise ValueError(f"a KV block holds a multiple of 8 positions, got {block_size}")
        self.block_size = block_size
        self.blocks_per_slot = -(-max_len // block_size)
        shape = (num_slots * self.blocks_per_slot, num_kv_heads, block_size, head_dim)
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.num_slots, self.max_len = num_slots, max_len
        self._rows_of: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows = torch.empty(0, dtype=torch.long)
        self._first_block = torch.arange(self.blocks_per_slot, dtype=torch.int32, device=device)

    def first_layers(self, n: int) -> KVCache:
        """A cache of this one's first ``n`` layers, sharing their storage (a draft model made of
        the target's first layers reads the target's keys and values: ``worker/drafting/draft_model.py``)."""
        view = KVCache.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        view.k, view.v = self.k[:n], self.v[:n]
        view._rows_of = None
        return view

    def block_tables(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Rows' block tables from their slots ([B] int32): [B, blocks_per_slot] int32."""
        if self.blocks_per_slot == 1:
            return slot_ids.view(-1, 1)
        first = slot_ids.to(torch.int32).view(-1, 1) * self.blocks_per_slot
        return (first + self._first_block.to(slot_ids.device)).contiguous()

    def cache_rows(self, slot_of_token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each token's row in the cache (block * block_size + offset), int64 [T]; computed once
        per batch (the layers all ask)."""
        seen = self._rows_of
        if seen is None or seen[0] is not slot_of_token or seen[1] is not positions:  # a batch's own tensors
            self._rows_of, self._rows = (slot_of_token, positions), self._slot_rows(slot_of_token, positions)
        return self._rows

    def _slot_rows(self, slot_of_token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return slot_of_token * (self.blocks_per_slot * self.block_size) + positions

    def write(
        self, layer: int, slot_of_token: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """k, v [T, kv_heads, D] for flat tokens of slots ``slot_of_token`` at ``positions``."""
        if self.blocks_per_slot == 1:
            self.k[layer][slot_of_token, :, positions] = k
            self.v[layer][slot_of_token, :, positions] = v
            return
        rows = self._slot_rows(slot_of_token, positions)  # (not memoized: the graphs rewrite their buffers)
        blocks, offsets = rows // self.block_size, rows % self.block_size
        self.k[layer][blocks, :, offsets] = k
        self.v[layer][blocks, :, offsets] = v

    def gather(self, layer: int, slots: list[int] | torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``slots`` up to ``length``: [B, kv_heads, length, D] (views where
        one block a slot and the slots are consecutive)."""
        k, v = self.k[layer], self.v[layer]
        if self.blocks_per_slot == 1:
            if isinstance(slots, list):
                first = slots[0]
                if slots == list(range(first, first + len(slots))):
                    return k[first : first + len(slots), :, :length], v[first : first + len(slots), :, :length]
                slots = torch.tensor(slots, device=k.device)
            return k[:, :, :length].index_select(0, slots), v[:, :, :length].index_select(0, slots)
        if isinstance(slots, list):
            slots = torch.tensor(slots, device=k.device)
        num = -(-length // self.block_size)
        tables = self.block_tables(slots.to(torch.int32))[:, :num].long()  # [B, num]
        return self._rows_of_blocks(k, tables, length), self._rows_of_blocks(v, tables, length)

    @staticmethod
    def _rows_of_blocks(cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
        b, num = tables.shape
        _, hkv, size, d = cache.shape
        blocks = cache[tables]  # [B, num, hkv, size, D]
        return blocks.permute(0, 2, 1, 3, 4).reshape(b, hkv, num * size, d)[:, :, :length]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Zeros; on the CPU from calloc (numpy's zeros), whose fresh pages the kernel zeroes when
    first touched: a 6 GB cache (16 slots x 8192 positions) is ready at once instead of after
    ~9 s of memset, and holds memory only where requests have written."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)
