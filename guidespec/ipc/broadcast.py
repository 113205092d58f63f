"""The scheduler's step broadcast: one write reaches every worker rank, local or remote.

Local ranks read the shared-memory ring; ranks on other hosts (Ray placements) read the
signed ZeroMQ stream of ``remote.py``. The scheduler writes each message to both. Which rank
reads what is decided once by the launcher and frozen in ``BroadcastSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import zmq

from guidespec.ipc.remote import RemoteReader, RemoteWriter
from guidespec.ipc.shm_ring import RingReader, RingSpec, ShmRing


@dataclass(frozen=True)
class BroadcastSpec:
    ring: RingSpec | None  # None: no rank reads locally (every rank a Ray actor)
    remote_endpoint: str | None = None  # tcp://ADDR:PORT the scheduler binds for remote ranks
    remote_key: str = ""  # hex HMAC key shared with remote ranks
    num_remote_readers: int = 0


class StepReader(Protocol):
    def read(self, timeout: float | None = 10.0) -> bytes: ...

    def close(self) -> None: ...


class StepBroadcaster:
    def __init__(self, spec: BroadcastSpec, ctx: zmq.Context) -> None:
        self.spec = spec
        self.ring = ShmRing.attach(spec.ring) if spec.ring is not None else None
        self.ring_writer = self.ring.writer() if self.ring is not None else None
        self.remote = None
        if spec.num_remote_readers:
            assert spec.remote_endpoint is not None
            self.remote = RemoteWriter(ctx, spec.remote_endpoint, bytes.fromhex(spec.remote_key))

    def wait_for_readers(self, timeout: float) -> None:
        if self.remote is not None:
            self.remote.wait_for_readers(self.spec.num_remote_readers, timeout)

    def write(self, payload: bytes, timeout: float) -> None:
        if self.remote is not None:
            self.remote.write(payload)
        if self.ring_writer is not None:
            self.ring_writer.write(payload, timeout=timeout)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        if self.ring is not None:
            self.ring.close()


class _RingStepReader:
    def __init__(self, ring: ShmRing, reader: RingReader) -> None:
        self.ring, self.reader = ring, reader

    def read(self, timeout: float | None = 10.0) -> bytes:
        return self.reader.read(timeout)

    def close(self) -> None:
        self.ring.close()


def create_step_reader(spec: BroadcastSpec, ring_index: int | None, ctx: zmq.Context) -> StepReader:
    """The ring reader ``ring_index``, or the remote stream when ``ring_index`` is None."""
    if ring_index is None:
        if spec.remote_endpoint is None:
            raise ValueError("this rank reads remotely but the broadcast has no remote endpoint")
        return RemoteReader(ctx, spec.remote_endpoint, bytes.fromhex(spec.remote_key))
    assert spec.ring is not None, "a local rank needs the ring"
    ring = ShmRing.attach(spec.ring)
    return _RingStepReader(ring, ring.reader(ring_index))
