"""The key/value cache, in blocks: one [kv_heads, num_blocks, block_size, head_dim] pair per layer
(a head's blocks together: a request's consecutive blocks are one run of its keys).

A request's keys at position p live in block ``tables[slot, p // block_size]`` at ``p %
block_size``: ``tables`` ([num_slots, blocks_per_slot] int32) is each slot's block table. With a
pool (``num_blocks``) the scheduler decides the tables (``scheduler/kv_blocks.py``: blocks
allocated as a request grows, full blocks shared between requests whose prompts start the same
way) and sends their changes with each step (:meth:`set_tables`); entries past a table's end point
at the scratch block (the pool's last), which only padding writes. Without a pool each slot owns
``blocks_per_slot`` consecutive blocks (the cache by slot: what a drafter's own cache, and a model
run alone in the tests, use). Rewinding a request (rejected drafts) needs no work here: the
scheduler lowers its computed length and later writes overwrite the stale positions.

Everything that reads or writes the cache goes through a row's block table (:meth:`block_tables`)
or a token's cache row (:meth:`cache_rows`, block * block_size + offset): the CPU kernels
(``kernels.cache_attention``), the torch paths (:meth:`write`, :meth:`gather`) and the CUDA graphs,
whose captured gathers read ``tables`` in place (its width fixed: ``max_len / block_size``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

_FEW_TABLES = 8  # set_tables' changes written slot by slot up to this many slots, else in one indexed write


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
        num_blocks: int | None = None,
    ) -> None:
        block_size = block_size or max_len
        if block_size != max_len and block_size % 8:
            raise ValueError(f"a KV block holds a multiple of 8 positions, got {block_size}")
        self.block_size = block_size
        self.blocks_per_slot = -(-max_len // block_size)
        self.paged = num_blocks is not None
        if num_blocks is None:  # by slot: slot s owns blocks s * blocks_per_slot onwards
            first = torch.arange(num_slots, dtype=torch.int32)[:, None] * self.blocks_per_slot
            tables = first + torch.arange(self.blocks_per_slot, dtype=torch.int32)[None]
            total = num_slots * self.blocks_per_slot
        else:  # a pool and its scratch block (the last): every entry there until the scheduler says
            tables = torch.full((num_slots, self.blocks_per_slot), num_blocks, dtype=torch.int32)
            total = num_blocks + 1
        self.scratch_block = total - 1  # (with a pool: its size, the blocks the scheduler may allocate)
        shape = (num_kv_heads, total, block_size, head_dim)
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.tables = tables.to(device)
        self._host_tables = tables  # (the CPU's copy: where set_tables writes first on CUDA)
        self._host_array = tables.numpy()  # (its memory: ``.numpy()`` a step cost a few µs)
        self.num_slots, self.max_len = num_slots, max_len
        self._rows_of: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows = torch.empty(0, dtype=torch.long)
        self._tables_of: torch.Tensor | None = None
        self._tables = torch.empty(0, dtype=torch.int32)
        self._heads = torch.arange(num_kv_heads, device=device)[None, :, None]  # (the gathers' head index)

    def set_tables(self, slots: np.ndarray, lengths: np.ndarray, blocks: np.ndarray) -> None:
        """Slot ``slots[i]``'s table is now the next ``lengths[i]`` of ``blocks`` (then the
        scratch block): the scheduler's changes since the last step."""
        if not self.paged:
            raise RuntimeError("block tables come from the scheduler only with a pool of blocks")
        host, table = self._host_tables, self._host_array
        slots, lengths = np.asarray(slots, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        if len(slots) <= _FEW_TABLES:  # (a steady step's: a few rows past a block's end; ~40 -> ~10 µs)
            listed, counts = slots.tolist(), lengths.tolist()
            if len(set(listed)) != len(listed) or sum(counts) != len(blocks) or min(counts, default=0) < 0:
                raise ValueError("block tables: each slot once, its length of the blocks given")
            start = 0
            for slot, count in zip(listed, counts):
                row = table[slot]
                row[:count] = blocks[start : start + count]
                row[count:] = self.scratch_block
                start += count
        else:  # in one indexed write (a torch slice a slot cost ~10 µs: 64 tables a step at 64 rows)
            if len(np.unique(slots)) != len(slots) or lengths.sum() != len(blocks) or (lengths < 0).any():
                raise ValueError("block tables: each slot once, its length of the blocks given")
            table[slots] = self.scratch_block
            starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
            table[np.repeat(slots, lengths), np.arange(len(blocks)) - starts] = blocks
        if self.tables is not host:  # (copies that do not wait for the steps still running)
            index = torch.from_numpy(slots)
            device = self.tables.device
            self.tables.index_copy_(0, index.to(device, non_blocking=True), host[index].to(device, non_blocking=True))
        self._rows_of = self._tables_of = None

    def first_layers(self, n: int) -> KVCache:
        """A cache of this one's first ``n`` layers, sharing their storage (a draft model made of
        the target's first layers reads the target's keys and values: ``worker/drafting/draft_model.py``)."""
        view = KVCache.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        view.k, view.v = self.k[:n], self.v[:n]
        view._rows_of = view._tables_of = None
        return view

    def block_tables(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Rows' block tables from their slots ([B] int32): [B, blocks_per_slot] int32 (computed
        once per group of rows: the layers all ask)."""
        if self._tables_of is not slot_ids:
            if self.tables.device.type == "cpu":  # (NumPy: a torch op's dispatch costs more at a few rows)
                self._tables = torch.from_numpy(self.tables.numpy()[slot_ids.numpy()])
            else:
                self._tables = self.tables.index_select(0, slot_ids.long())
            self._tables_of = slot_ids
        return self._tables

    def cache_rows(self, slot_of_token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each token's row in the cache (block * block_size + offset), int64 [T]; computed once
        per batch (the layers all ask)."""
        seen = self._rows_of
        if seen is None or seen[0] is not slot_of_token or seen[1] is not positions:  # a batch's own tensors
            self._rows_of, self._rows = (slot_of_token, positions), self._slot_rows(slot_of_token, positions)
        return self._rows

    def _slot_rows(self, slot_of_token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.tables.device.type == "cpu" and positions.device.type == "cpu":
            # (NumPy: five torch ops' dispatch is most of a decode step's indexing at a few rows)
            size, at = self.block_size, positions.numpy()
            blocks = self.tables.numpy()[slot_of_token.numpy(), at // size]
            return torch.from_numpy(blocks.astype(np.int64) * size + at % size)
        blocks, offsets = self.locate(slot_of_token, positions)
        return blocks * self.block_size + offsets

    def locate(self, slot_of_token: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's block and offset in it (int64 [T] each), computed afresh: the padded
        forward asks once for all its layers, so a captured graph recomputes them at each replay
        from the buffers it reads (a memo kept across calls would be captured stale)."""
        size = self.block_size
        blocks = self.tables[slot_of_token, torch.div(positions, size, rounding_mode="floor")].long()
        return blocks, positions % size

    def write_at(self, layer: int, where: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, kv_heads, D] at :meth:`locate`'s blocks and offsets."""
        blocks, offsets = where
        self.k[layer][:, blocks, offsets] = k.transpose(0, 1)
        self.v[layer][:, blocks, offsets] = v.transpose(0, 1)

    def write(
        self, layer: int, slot_of_token: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """k, v [T, kv_heads, D] for flat tokens of slots ``slot_of_token`` at ``positions``."""
        self.write_at(layer, self.locate(slot_of_token, positions), k, v)

    def row_tables(self, slots: torch.Tensor, length: int) -> torch.Tensor:
        """The first blocks of each row's table that hold ``length`` keys: int64 [B, num], computed
        afresh (once per padded forward, as :meth:`locate`)."""
        num = -(-length // self.block_size)
        return self.tables.index_select(0, slots.long())[:, :num].long()

    def gather(self, layer: int, slots: list[int] | torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``slots`` up to ``length``: [B, kv_heads, length, D]."""
        if isinstance(slots, list):
            slots = torch.tensor(slots, device=self.tables.device)
        return self.gather_tables(layer, self.row_tables(slots, length), length)

    def gather_tables(self, layer: int, tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the rows whose :meth:`row_tables` are ``tables``: [B, kv_heads, length, D],
        each one gather (one kernel on CUDA)."""
        return self._rows_of_blocks(self.k[layer], tables, length), self._rows_of_blocks(self.v[layer], tables, length)

    def _rows_of_blocks(self, cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
        b, num = tables.shape
        hkv, _, size, d = cache.shape
        blocks = cache[self._heads, tables[:, None, :]]  # [B, hkv, num, size, D], laid out so already
        return blocks.view(b, hkv, num * size, d)[:, :, :length]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Zeros; on the CPU from calloc (numpy's zeros), whose fresh pages the kernel zeroes when
    first touched: a 6 GB cache (16 slots x 8192 positions) is ready at once instead of after
    ~9 s of memset, and holds memory only where requests have written."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)
