"""Tensor-parallel collectives between CPU ranks on one host, through shared memory.

Gloo's collectives go over TCP through its own threads: each one is a few system calls and
thread hand-offs on each rank. A decode step of the default model has 61 of them (two
all-reduces a layer, the embedding's, the LM head's gather, the tokens' broadcast), and on a
2-core host, where two ranks share the cores with the scheduler and the client, each waited
on a context switch: TP=2 ran the 5-request steady decode of ``tests/test_engine.py`` at
~186 ms a step against TP=1's ~50 (the workers ~55% busy each, a third of the CPU in the
kernel).

Here every collective is one exchange: each rank copies its tensor into its own slot of the
segment, then bumps its sequence word and wakes whoever sleeps on it (a futex); it waits until
every other rank's word has reached the same count, and reads what it needs from their slots
(an all-reduce adds every slot in rank order, so every rank holds the same bits; a gather's
rank 0 concatenates them; a broadcast reads rank 0's). Slots alternate between two buffers by
the count's parity: a rank writes collective k's slot only once it is past k - 1, which every
rank has posted, and a rank that has posted k - 1 is done reading k - 2's buffer, the one k
writes again.

A tensor over ``slot_bytes`` goes through gloo instead (every rank takes the same path: the
sizes are the same on every rank). A wait sleeps in 50 ms futex waits and checks, between
them, that the ranks it waits for are alive (their pids are in the header): a dead rank's
peers raise instead of hanging (the launcher then sees the death, as with gloo).

Ordering: the slot, then the sequence word; on x86 (TSO) a rank that sees the word sees the
slot (as ``shm_ring.py``). The launcher makes it only for x86-64 CPU ranks that are all local.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import TYPE_CHECKING

import numpy as np

from guidespec.ipc import futex
from guidespec.ipc.segments import attach_segment, close_segment, create_segment
from guidespec.process_utils import process_alive

if TYPE_CHECKING:  # (torch is imported where a rank attaches: the layout travels in configs the client builds)
    import torch

_LINE = 64  # a rank's sequence word and pid have a cache line to themselves
_SPINS = 200  # checks of a peer's word before sleeping on it (a few microseconds)
_SLEEP_S = 0.05  # a futex wait, between checks that the peers are alive


@dataclass(frozen=True)
class CollectivesLayout:
    name: str
    num_ranks: int
    slot_bytes: int

    @property
    def size(self) -> int:
        return self.num_ranks * _LINE + 2 * self.num_ranks * self.slot_bytes


class RankDied(RuntimeError):
    """A rank that a collective waits for is no longer alive."""


class ShmCollectives:
    def __init__(self, shm: shared_memory.SharedMemory, layout: CollectivesLayout, rank: int, owner: bool) -> None:
        self.layout = layout
        self.rank = rank
        self._shm = shm
        self._owner = owner
        n = layout.num_ranks
        header = np.ndarray((n, _LINE // 4), dtype=np.uint32, buffer=shm.buf)
        self._seq = header[:, 0]  # (strided: each rank's word on its own line)
        self._pids = header[:, 1]
        self._addresses = [header[r].__array_interface__["data"][0] for r in range(n)]
        self._slots: torch.Tensor | None = None
        self._count = 0
        if rank >= 0:  # (the owner takes part in no collective: it needs no torch)
            import torch

            self._slots = torch.frombuffer(shm.buf, dtype=torch.uint8, offset=n * _LINE).view(2, n, layout.slot_bytes)
            self._count = int(self._seq[rank])

    @classmethod
    def create(cls, layout: CollectivesLayout) -> ShmCollectives:
        """The owner's (the launcher's): it takes part in no collective."""
        return cls(create_segment(layout.name, layout.size), layout, rank=-1, owner=True)

    @classmethod
    def attach(cls, layout: CollectivesLayout, rank: int) -> ShmCollectives:
        if not 0 <= rank < layout.num_ranks:
            raise ValueError(f"rank {rank} outside [0, {layout.num_ranks})")
        collectives = cls(attach_segment(layout.name), layout, rank, owner=False)
        collectives._pids[rank] = os.getpid()
        return collectives

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.layout.slot_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (contiguous, ``fits``) summed over the ranks, in place: every rank the same bits."""
        slots = self._exchange(x)
        flat = x.view(-1)
        flat.copy_(slots[0])
        for other in slots[1:]:
            flat.add_(other)
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape on each, ``fits``) on rank 0, in rank order, None on the
        other ranks: views of the slots, good until the collective after next (copy them)."""
        slots = self._exchange(x)
        if self.rank != 0:
            return None
        return [slot.view(x.shape) for slot in slots]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (the others' ``x`` overwritten in place)."""
        slots = self._exchange(x, post=self.rank == 0)
        if self.rank != 0:
            x.view(-1).copy_(slots[0])
        return x

    def _exchange(self, x: torch.Tensor, post: bool = True) -> list[torch.Tensor]:
        """Post ``x`` (with ``post``; else nothing, as a broadcast's receivers) as this rank's part
        of the next collective, wait for every rank's, and return their slots as flat views of
        ``x``'s size and dtype."""
        self._count = (self._count + 1) & 0xFFFFFFFF
        count = self._count
        assert self._slots is not None
        buffer = self._slots[count & 1]
        dtype, nbytes = x.dtype, x.numel() * x.element_size()
        if post:
            buffer[self.rank, :nbytes].view(dtype).copy_(x.reshape(-1))
        self._seq[self.rank] = count
        futex.wake(self._addresses[self.rank])
        for other in range(self.layout.num_ranks):
            if other != self.rank:
                self._wait(other, count)
        return [buffer[r, :nbytes].view(dtype) for r in range(self.layout.num_ranks)]

    def _wait(self, other: int, count: int) -> None:
        """Until rank ``other`` has posted collective ``count`` (it may be one past it already)."""
        for _ in range(_SPINS):
            seen = int(self._seq[other])
            if (seen - count) & 0xFFFFFFFF <= 1:
                return
        while (seen - count) & 0xFFFFFFFF > 1:
            futex.wait(self._addresses[other], seen, _SLEEP_S)
            pid = int(self._pids[other])
            seen = int(self._seq[other])
            if (seen - count) & 0xFFFFFFFF > 1 and pid and not process_alive(pid):
                raise RankDied(f"tensor-parallel rank {other} (pid {pid}) died during a collective")

    def close(self) -> None:
        self._slots = None  # type: ignore[assignment]  # drop the views before closing the mapping
        self._seq = self._pids = None  # type: ignore[assignment]
        close_segment(self._shm, self._owner)
