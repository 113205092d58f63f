"""The scheduler's step broadcast: one write reaches every worker rank, local or remote.

Local ranks read the shared-memory ring; ranks on other hosts (Ray placements) read the
signed ZeroMQ stream of ``remote.py``. The scheduler writes each message to both. Which rank
reads what is decided once by the launcher and frozen in ``BroadcastLayout``. A step's bitmask
reaches local ranks through the mask arena (``mask_arena.py``: the ring carries its header
only) and remote ranks whole.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import zmq

import numpy as np

from guidespec.ipc import codec
from guidespec.ipc.codec import MalformedMessage
from guidespec.ipc.mask_arena import ArenaLayout, MaskArena
from guidespec.ipc.remote import RemoteReader, RemoteWriter
from guidespec.ipc.shm_ring import RingReader, RingLayout, ShmRing


class StepBitmask(Protocol):
    """What the broadcast needs of ``protocol.StepBitmask`` (ipc sits below the messages)."""

    @property
    def step(self) -> int: ...
    @property
    def rows(self) -> np.ndarray: ...
    @property
    def bitmask(self) -> np.ndarray | None: ...
    @property
    def arena_buffer(self) -> int: ...


@dataclass(frozen=True)
class BroadcastLayout:
    ring: RingLayout | None  # None: no rank reads locally (every rank a Ray actor)
    remote_endpoint: str | None = None  # tcp://ADDR:PORT the scheduler binds for remote ranks
    remote_key: str = ""  # hex HMAC key shared with remote ranks
    num_remote_readers: int = 0
    arena: ArenaLayout | None = None  # the bitmask arena local ranks map (None: masks through the ring)


class StepReader(Protocol):
    def read(self, timeout: float | None = 10.0) -> bytes: ...

    def poll(self) -> bool:
        """True if a message is waiting (``read`` returns it at once)."""
        ...

    def bitmask(self, message: StepBitmask) -> np.ndarray:
        """The message's bitmask rows [R, words], wherever they travelled (MalformedMessage: none)."""
        ...

    def arena_buffers(self) -> list[np.ndarray]:
        """The mask arena's buffers this rank maps (to page-lock them on a GPU); none remotely."""
        ...

    def close(self) -> None: ...


class StepBroadcaster:
    def __init__(self, layout: BroadcastLayout, ctx: zmq.Context) -> None:
        self.layout = layout
        self.ring = ShmRing.attach(layout.ring) if layout.ring is not None else None
        self.ring_writer = self.ring.writer() if self.ring is not None else None
        self.arena = MaskArena.attach(layout.arena) if layout.arena is not None and self.ring is not None else None
        self.remote = None
        if layout.num_remote_readers:
            assert layout.remote_endpoint is not None
            self.remote = RemoteWriter(ctx, layout.remote_endpoint, bytes.fromhex(layout.remote_key))

    def wait_for_readers(self, timeout: float) -> None:
        if self.remote is not None:
            self.remote.wait_for_readers(self.layout.num_remote_readers, timeout)

    def write(self, payload: bytes, timeout: float) -> None:
        if self.remote is not None:
            self.remote.write(payload)
        if self.ring_writer is not None:
            self.ring_writer.write(payload, timeout=timeout)

    def reserve_bitmask(self) -> np.ndarray | None:
        """A buffer of the mask arena to fill the next step's bitmask into (None: no arena)."""
        return self.arena.reserve()[1] if self.arena is not None else None

    def write_bitmask(self, message: StepBitmask, timeout: float) -> None:
        """Remote ranks get the whole message; local ranks the rows in the arena and the header
        on the ring (the whole message where the arena cannot hold it)."""
        if self.remote is not None:
            self.remote.write(codec.encode(message))
        if self.ring_writer is None:
            return
        assert message.bitmask is not None
        if self.arena is not None and self.arena.fits(message.bitmask):
            buffer = self.arena.index_of(message.bitmask)  # filled in place (``reserve_bitmask``)
            if buffer is None:
                buffer = self.arena.put(message.bitmask)
            message = dataclasses.replace(message, bitmask=None, arena_buffer=buffer)  # type: ignore[type-var]
        self.ring_writer.write(codec.encode(message), timeout=timeout)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        if self.arena is not None:
            self.arena.close()
        if self.ring is not None:
            self.ring.close()


class _RingStepReader:
    def __init__(self, ring: ShmRing, reader: RingReader, arena: MaskArena | None) -> None:
        self.ring, self.reader, self.arena = ring, reader, arena

    def read(self, timeout: float | None = 10.0) -> bytes:
        return self.reader.read(timeout)

    def poll(self) -> bool:
        return self.reader.poll()

    def bitmask(self, message: StepBitmask) -> np.ndarray:
        if message.arena_buffer < 0:
            return _rows_in(message)
        if self.arena is None:
            raise RuntimeError(f"step {message.step}: its bitmask is in the arena, which this rank does not map")
        return self.arena.view(message.arena_buffer, len(message.rows))

    def arena_buffers(self) -> list[np.ndarray]:
        return [] if self.arena is None else [self.arena.buffers]

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
        self.ring.close()


class _RemoteStepReader(RemoteReader):
    def bitmask(self, message: StepBitmask) -> np.ndarray:
        return _rows_in(message)  # remote ranks always get the rows in the message

    def arena_buffers(self) -> list[np.ndarray]:
        return []


def _rows_in(message: StepBitmask) -> np.ndarray:
    if message.bitmask is None:
        raise MalformedMessage(f"step {message.step}: a bitmask message without rows or an arena buffer")
    return message.bitmask


def create_step_reader(layout: BroadcastLayout, ring_index: int | None, ctx: zmq.Context) -> StepReader:
    """The ring reader ``ring_index``, or the remote stream when ``ring_index`` is None."""
    if ring_index is None:
        if layout.remote_endpoint is None:
            raise ValueError("this rank reads remotely but the broadcast has no remote endpoint")
        return _RemoteStepReader(ctx, layout.remote_endpoint, bytes.fromhex(layout.remote_key))
    assert layout.ring is not None, "a local rank needs the ring"
    ring = ShmRing.attach(layout.ring)
    arena = MaskArena.attach(layout.arena) if layout.arena is not None else None
    return _RingStepReader(ring, ring.reader(ring_index), arena)
