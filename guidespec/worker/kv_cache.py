"""The key/value cache, indexed by slot: one [slots, kv_heads, max_len, head_dim] pair per layer.

A slot belongs to one request for its whole life; a request's keys at position p live at
``[slot, :, p]``. Rewinding a request (rejected drafts) needs no work here: the scheduler
lowers its computed length and later writes overwrite the stale positions.

The CPU kernels read a cache in blocks (``kernels.cache_attention``: [num_blocks, kv_heads,
block_size, head_dim] and a block table per row); a cache by slot is that with one block of
``max_len`` positions a row: the slot's (:meth:`KVCache.block_tables`, :meth:`KVCache.cache_rows`).
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
    ) -> None:
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.num_slots, self.max_len = num_slots, max_len
        self._rows_of: object = None
        self._rows = torch.empty(0, dtype=torch.long)

    def first_layers(self, n: int) -> KVCache:
        """A cache of this one's first ``n`` layers, sharing their storage (a draft model made of
        the target's first layers reads the target's keys and values: ``worker/drafting/draft_model.py``)."""
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[:n], self.v[:n]
        view.num_slots, view.max_len = self.num_slots, self.max_len
        view._rows_of, view._rows = None, self._rows
        return view

    def block_tables(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Rows' block tables for the kernels, from their slots ([B] int32): [B, 1], the slot."""
        return slot_ids.view(-1, 1)

    def cache_rows(self, slot_of_token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each token's row in the cache as blocks of ``max_len`` (block * max_len + position),
        int64 [T]; computed once per batch (the layers all ask)."""
        if self._rows_of is not slot_of_token:
            self._rows_of, self._rows = slot_of_token, slot_of_token * self.max_len + positions
        return self._rows

    def write(
        self, layer: int, slot_of_token: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """k, v [T, kv_heads, D] for flat tokens of slots ``slot_of_token`` at ``positions``."""
        self.k[layer][slot_of_token, :, positions] = k
        self.v[layer][slot_of_token, :, positions] = v

    def gather(self, layer: int, slots: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``slots`` up to ``length``: [B, kv_heads, length, D] (views where contiguous)."""
        k, v = self.k[layer], self.v[layer]
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            return k[first : first + len(slots), :, :length], v[first : first + len(slots), :, :length]
        index = torch.tensor(slots, device=k.device)
        return k[index, :, :length], v[index, :, :length]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Zeros; on the CPU from calloc (numpy's zeros), whose fresh pages the kernel zeroes when
    first touched: a 6 GB cache (16 slots x 8192 positions) is ready at once instead of after
    ~9 s of memset, and holds memory only where requests have written."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)
