"""A single-writer / multi-reader ring buffer in shared memory.

The scheduler writes each step's messages once; every local worker reads all of them. The
segment holds ``num_slots`` fixed-size slots, one header per slot, and one read cursor per
reader (the reader's "read flags": reader ``r`` has read every chunk below its cursor).

- A message larger than a slot is split over consecutive slots (chunks); the first chunk
  carries the message length, readers reassemble.
- The writer may overwrite a slot only when every live reader's cursor has passed it. A
  reader marked dead (``mark_reader_dead``) no longer holds the writer back.
- A message may be at most ``MAX_MESSAGE_SIZE`` bytes; the writer refuses a larger one before
  writing anything.
- A reader checks every slot header against the framing the writer keeps (a first chunk's
  total in ``[0, MAX_MESSAGE_SIZE]``, every chunk full but the last, continuations marked -1)
  and raises ``RingCorrupt`` on any other; it copies chunk by chunk, so a corrupt total cannot
  make it allocate more than was written.
- A reader waits by spinning for a few microseconds (a step's messages arrive back to back),
  then sleeping on the ring's bell, a futex word the writer rings after each chunk
  (``guidespec.ipc.futex``): it wakes as soon as the chunk is there and costs no CPU while it
  sleeps. Without futexes, and for the writer waiting on a full ring, waits sleep with a
  growing interval up to 1 ms. Every wait has a
  timeout (of running time: ``waiting.AwakeTimer``, so processes paused together and resumed
  go on) and raises ``RingTimeout`` naming who it waited for.

Ordering: data, then length, then the slot's sequence number are stored in that order; on
x86 (TSO) a reader that sees the sequence number sees the data. This module does not know
what a message is: it moves bytes (see ``guidespec.ipc.codec``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from guidespec.ipc import futex
from guidespec.ipc.segments import attach_segment, close_segment, create_segment
from guidespec.ipc.waiting import AwakeTimer

_CTRL_WORDS = 5  # num_readers, num_slots, slot_size, magic, bell (a uint32 futex word in the low half)
_MAGIC = 0x67756964  # "guid"
_CURSOR_STRIDE = 8  # int64 words between reader cursors: one cache line each
_SPIN_S = 50e-6
_MAX_SLEEP_S = 1e-3
MAX_MESSAGE_SIZE = 1 << 30  # far above any step's messages (a 512-row bitmask over 256k tokens: 16 MiB)


class RingTimeout(TimeoutError):
    """A ring wait passed its deadline."""


class RingCorrupt(RuntimeError):
    """A slot header the writer never writes: the segment was overwritten, or a reader lost its
    place. The reader cannot find the next message's start again."""


@dataclass(frozen=True)
class RingLayout:
    """What a process needs to attach to a ring: picklable, tiny."""

    name: str
    num_readers: int
    num_slots: int
    slot_size: int


class ShmRing:
    """One shared-memory segment; use ``create`` (owner), then ``writer``/``reader`` handles."""

    def __init__(self, shm: shared_memory.SharedMemory, layout: RingLayout, owner: bool) -> None:
        self.layout = layout
        self._shm = shm
        self._owner = owner
        n, s = layout.num_readers, layout.num_slots
        buf = shm.buf
        words = _CTRL_WORDS + 3 * s + _CURSOR_STRIDE * n + n
        ints = np.ndarray((words,), dtype=np.int64, buffer=buf)
        self.ctrl = ints[:_CTRL_WORDS]
        self.bell = np.ndarray((1,), dtype=np.uint32, buffer=buf, offset=4 * 8)  # ctrl[4]'s first 4 bytes
        self.bell_address = int(self.bell.ctypes.data)
        self.slot_seq = ints[_CTRL_WORDS : _CTRL_WORDS + s]
        self.slot_nbytes = ints[_CTRL_WORDS + s : _CTRL_WORDS + 2 * s]
        self.slot_total = ints[_CTRL_WORDS + 2 * s : _CTRL_WORDS + 3 * s]
        base = _CTRL_WORDS + 3 * s
        self.cursors = ints[base : base + _CURSOR_STRIDE * n : _CURSOR_STRIDE]
        self.reader_dead = ints[base + _CURSOR_STRIDE * n : base + _CURSOR_STRIDE * n + n]
        data_start = _round_up(words * 8, 64)
        self.data = np.ndarray((s, layout.slot_size), dtype=np.uint8, buffer=buf, offset=data_start)

    @classmethod
    def create(cls, name: str, num_readers: int, num_slots: int = 64, slot_size: int = 1 << 20) -> ShmRing:
        if num_readers < 1 or num_slots < 2 or slot_size < 64:
            raise ValueError("a ring needs >= 1 reader, >= 2 slots of >= 64 bytes")
        layout = RingLayout(name, num_readers, num_slots, slot_size)
        shm = create_segment(name, _segment_size(layout))
        ring = cls(shm, layout, owner=True)
        ring.slot_seq[:] = -1
        ring.cursors[:] = 0
        ring.reader_dead[:] = 0
        ring.ctrl[:] = (num_readers, num_slots, slot_size, _MAGIC, 0)
        return ring

    @classmethod
    def attach(cls, layout: RingLayout) -> ShmRing:
        shm = attach_segment(layout.name)
        ring = cls(shm, layout, owner=False)
        if int(ring.ctrl[3]) != _MAGIC:
            raise RuntimeError(f"shared memory {layout.name!r} is not a guidespec ring")
        return ring

    def writer(self) -> RingWriter:
        return RingWriter(self)

    def reader(self, index: int) -> RingReader:
        if not 0 <= index < self.layout.num_readers:
            raise ValueError(f"reader index {index} out of range [0, {self.layout.num_readers})")
        return RingReader(self, index)

    def mark_reader_dead(self, index: int) -> None:
        self.reader_dead[index] = 1

    def close(self) -> None:
        # Drop numpy views before closing the mapping.
        self.ctrl = self.slot_seq = self.slot_nbytes = self.slot_total = self.bell = None  # type: ignore[assignment]
        self.cursors = self.reader_dead = self.data = None  # type: ignore[assignment]
        close_segment(self._shm, self._owner)


class RingWriter:
    def __init__(self, ring: ShmRing) -> None:
        self.ring = ring
        self._next_chunk = 0

    def write(self, payload: bytes | memoryview, timeout: float = 10.0) -> None:
        """Write one message; blocks while the ring is full, up to ``timeout`` seconds."""
        ring = self.ring
        view = memoryview(payload).cast("B")
        size, slot_size = view.nbytes, ring.layout.slot_size
        if size > MAX_MESSAGE_SIZE:
            raise ValueError(
                f"ring {ring.layout.name}: a message of {size} bytes is over the limit of {MAX_MESSAGE_SIZE}"
            )
        timer = AwakeTimer(timeout)
        sent = 0
        while sent < size or sent == 0:
            chunk = self._next_chunk
            self._wait_free(chunk, timer)
            slot = chunk % ring.layout.num_slots
            n = min(slot_size, size - sent)
            ring.data[slot, :n] = np.frombuffer(view[sent : sent + n], dtype=np.uint8)
            ring.slot_nbytes[slot] = n
            ring.slot_total[slot] = size if sent == 0 else -1
            ring.slot_seq[slot] = chunk  # publish last
            np.add(ring.bell, 1, out=ring.bell)  # then ring the bell for readers asleep on it
            futex.wake(ring.bell_address)
            self._next_chunk = chunk + 1
            sent += n
            if size == 0:
                break

    def _wait_free(self, chunk: int, timer: AwakeTimer) -> None:
        ring = self.ring
        oldest_allowed = chunk - ring.layout.num_slots
        backoff = None  # (made on the first wait: the usual write has none)
        while True:
            lagging = [
                r
                for r in range(ring.layout.num_readers)
                if not ring.reader_dead[r] and ring.cursors[r] <= oldest_allowed
            ]
            if not lagging:
                return
            if backoff is None:
                backoff = _Backoff(timer)
            if not backoff.wait():
                raise RingTimeout(
                    f"ring {ring.layout.name}: reader(s) {lagging} did not free a slot in time"
                    " (a dead or stuck reader?)"
                )


class RingReader:
    def __init__(self, ring: ShmRing, index: int) -> None:
        self.ring = ring
        self.index = index
        # a message whose later chunks did not come in time: (its chunks read, bytes to come, its
        # size), which the next read goes on with (its chunks are off the ring already)
        self._partial: tuple[list[bytes], int, int] | None = None

    def read(self, timeout: float | None = 10.0) -> bytes:
        """Read the next message (a private copy). ``timeout=None`` waits forever.

        Raises ``RingTimeout`` when a chunk does not come in time: where that was a later chunk of
        a message, the next read goes on with it (rank 0's short wait for a bitmask, which a
        multi-chunk message crossed, once lost its first chunks). ``RingCorrupt`` on a slot header
        the writer never writes (the cursor stays on that chunk)."""
        ring = self.ring
        timer = AwakeTimer(timeout)
        if self._partial is None:
            slot, n, total = self._wait_chunk(timer)
            if not 0 <= total <= MAX_MESSAGE_SIZE:
                raise self._corrupt(f"a message of {total} bytes")
            chunks: list[bytes] = []
            remaining = total
        else:
            chunks, remaining, total = self._partial
            slot, n = self._next_chunk(timer, chunks, remaining, total)
        while True:
            if n != min(remaining, ring.layout.slot_size):
                raise self._corrupt(f"a chunk of {n} bytes with {remaining} of {total} bytes to come")
            chunks.append(ring.data[slot, :n].tobytes())
            self._advance()
            remaining -= n
            if remaining == 0:
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            slot, n = self._next_chunk(timer, chunks, remaining, total)

    def _next_chunk(self, timer: AwakeTimer, chunks: list[bytes], remaining: int, total: int) -> tuple[int, int]:
        """A message's next chunk (slot, bytes); kept for the next read if it does not come in time."""
        try:
            slot, n, marker = self._wait_chunk(timer)
        except RingTimeout:
            self._partial = (chunks, remaining, total)
            raise
        self._partial = None
        if marker != -1:
            raise self._corrupt(f"a new message of {marker} bytes with {remaining} of {total} bytes to come")
        return slot, n

    def poll(self) -> bool:
        """True if a message is waiting."""
        cursor = int(self.ring.cursors[self.index])
        return int(self.ring.slot_seq[cursor % self.ring.layout.num_slots]) == cursor

    def _wait_chunk(self, timer: AwakeTimer) -> tuple[int, int, int]:
        ring = self.ring
        cursor = int(ring.cursors[self.index])
        slot = cursor % ring.layout.num_slots
        backoff = _Backoff(timer, ring)
        while True:
            bell = int(ring.bell[0])  # before the check: a chunk published after it rings a new value
            if int(ring.slot_seq[slot]) == cursor:
                break
            if not backoff.wait(bell):
                raise RingTimeout(f"ring {ring.layout.name}: reader {self.index} got no message in time")
        return slot, int(ring.slot_nbytes[slot]), int(ring.slot_total[slot])

    def _advance(self) -> None:
        self.ring.cursors[self.index] += 1

    def _corrupt(self, what: str) -> RingCorrupt:
        cursor = int(self.ring.cursors[self.index])
        return RingCorrupt(f"ring {self.ring.layout.name}: reader {self.index} found {what} at chunk {cursor}")


class _Backoff:
    """Spin briefly, then sleep until the timer expires: on the ring's bell (``bell``: the value
    read before the caller's check), else with a doubling interval up to 1 ms."""

    def __init__(self, timer: AwakeTimer, ring: ShmRing | None = None) -> None:
        self.timer = timer
        self.start = time.monotonic()
        self.sleep = 20e-6
        self.bell_address = ring.bell_address if ring is not None and futex.available() else None

    def wait(self, bell: int | None = None) -> bool:
        if self.timer.expired():
            return False
        now = time.monotonic()
        if now - self.start <= _SPIN_S:
            return True
        if self.bell_address is not None and bell is not None:
            futex.wait(self.bell_address, bell, _MAX_SLEEP_S)  # at most 1 ms: the timer is checked between
        else:
            time.sleep(self.sleep)
            self.sleep = min(self.sleep * 2, _MAX_SLEEP_S)
        return True


def _segment_size(layout: RingLayout) -> int:
    words = _CTRL_WORDS + 3 * layout.num_slots + _CURSOR_STRIDE * layout.num_readers + layout.num_readers
    return _round_up(words * 8, 64) + layout.num_slots * layout.slot_size


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple
