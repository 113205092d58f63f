"""The bitmask arena: token bitmasks in shared memory, written once, read in place.

A step's bitmask (one int32 row of ``ceil(vocab / 32)`` words per logits row to verify) is the
largest thing a step sends: 64 rows of a 49k vocabulary are 393 KB, 1,024 rows of a 128k one
16 MB. Through the ring it would be encoded, copied into slots and reassembled by every reader.
Here the scheduler copies it once into one of ``num_buffers`` buffers of a shared segment and
the ring carries only ``StepBitmask``'s header (step, row map, which buffer); each local rank
reads the rows in place, as a numpy view. Remote ranks (no shared memory) still get the whole
message over their stream (``broadcast.py``).

Buffers alternate step by step. A buffer is written again two masks later, and by then every
rank is done with it: the scheduler writes step N+1's mask only after rank 0's outputs of step
N, which need every rank past step N's logits (the LM head's gather is collective).
On a GPU this segment is what gets page-locked for asynchronous copies (issue 22).
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from guidespec.ipc.segments import attach_segment, close_segment, create_segment


@dataclass(frozen=True)
class ArenaLayout:
    """What a process needs to attach: the segment's name and shape."""

    name: str
    num_rows: int  # rows per buffer: a step with more goes through the ring instead
    num_words: int  # int32 words per row: ceil(vocab / 32)
    num_buffers: int = 2


class MaskArena:
    def __init__(self, shm: shared_memory.SharedMemory, layout: ArenaLayout, owner: bool) -> None:
        self.layout = layout
        self._shm = shm
        self._owner = owner
        self.buffers = np.ndarray(
            (layout.num_buffers, layout.num_rows, layout.num_words), dtype=np.int32, buffer=shm.buf
        )
        self._addresses = [self.buffers[i].__array_interface__["data"][0] for i in range(layout.num_buffers)]
        self._next = 0

    @classmethod
    def create(cls, layout: ArenaLayout) -> MaskArena:
        if layout.num_rows < 1 or layout.num_words < 1 or layout.num_buffers < 2:
            raise ValueError("an arena needs >= 1 row of >= 1 word and >= 2 buffers")
        size = layout.num_buffers * layout.num_rows * layout.num_words * 4
        return cls(create_segment(layout.name, size), layout, owner=True)

    @classmethod
    def attach(cls, layout: ArenaLayout) -> MaskArena:
        return cls(attach_segment(layout.name), layout, owner=False)

    def fits(self, bitmask: np.ndarray) -> bool:
        return (
            bitmask.ndim == 2 and bitmask.shape[0] <= self.layout.num_rows and bitmask.shape[1] == self.layout.num_words
        )

    def reserve(self) -> tuple[int, np.ndarray]:
        """The next buffer, whole [num_rows, num_words], to fill in place; and its index."""
        index = self._next
        self._next = (index + 1) % self.layout.num_buffers
        return index, self.buffers[index]

    def index_of(self, bitmask: np.ndarray) -> int | None:
        """The buffer ``bitmask`` is the first rows of, if it is one (filled in place)."""
        if bitmask.ndim != 2 or bitmask.shape[1] != self.layout.num_words:
            return None
        address = bitmask.__array_interface__["data"][0]
        return next((i for i, start in enumerate(self._addresses) if start == address), None)

    def put(self, bitmask: np.ndarray) -> int:
        """Copy ``bitmask`` [rows, words] into the next buffer; returns the buffer's index."""
        if not self.fits(bitmask):
            raise ValueError(
                f"a bitmask of shape {bitmask.shape} does not fit the arena "
                f"({self.layout.num_rows} rows of {self.layout.num_words} words)"
            )
        index, buffer = self.reserve()
        buffer[: bitmask.shape[0]] = bitmask
        return index

    def view(self, index: int, num_rows: int) -> np.ndarray:
        """The first ``num_rows`` rows of buffer ``index``, in place (read-only)."""
        if not (0 <= index < self.layout.num_buffers and 0 <= num_rows <= self.layout.num_rows):
            raise ValueError(f"no rows [0, {num_rows}) in arena buffer {index}")
        rows = self.buffers[index, :num_rows]
        rows.flags.writeable = False
        return rows

    def close(self) -> None:
        self.buffers = None  # type: ignore[assignment]  # drop the view before closing the mapping
        close_segment(self._shm, self._owner)
