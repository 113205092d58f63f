"""The bitmask arena: rows written once into shared memory and read in place by another
process's mapping; buffers alternate; the ring carries only the header; a bitmask the arena
cannot hold goes through the ring whole."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import zmq

from guidespec.ipc import codec
from guidespec.ipc.broadcast import BroadcastLayout, StepBroadcaster, create_step_reader
from guidespec.ipc.mask_arena import ArenaLayout, MaskArena
from guidespec.ipc.shm_ring import ShmRing
from guidespec.protocol import StepBitmask

WORDS = 1536  # SmolLM2's 49,152 tokens


def _arena(rows: int = 8) -> MaskArena:
    return MaskArena.create(ArenaLayout(f"guidespec-test-{uuid.uuid4().hex[:8]}-masks", rows, WORDS))


def test_rows_put_by_the_owner_are_read_in_place_by_an_attached_mapping() -> None:
    owner = _arena()
    reader = MaskArena.attach(owner.layout)
    rng = np.random.default_rng(0)
    first, second = (rng.integers(-(2**31), 2**31, (n, WORDS), dtype=np.int64).astype(np.int32) for n in (5, 8))
    a, b = owner.put(first), owner.put(second)
    assert (a, b) == (0, 1) and owner.put(first) == 0  # buffers alternate
    assert np.array_equal(reader.view(a, 5), first) and np.array_equal(reader.view(b, 8), second)
    with pytest.raises(ValueError):
        reader.view(a, 5)[0, 0] = 1  # read-only
    with pytest.raises(ValueError, match="does not fit"):
        owner.put(np.zeros((9, WORDS), dtype=np.int32))
    reader.close()
    owner.close()


def test_the_ring_carries_the_header_and_a_bitmask_too_big_goes_whole() -> None:
    ring = ShmRing.create(f"guidespec-test-{uuid.uuid4().hex[:8]}", 1, 4, 1 << 20)
    arena = _arena(rows=4)
    ctx = zmq.Context()
    spec = BroadcastLayout(ring.layout, arena=arena.layout)
    writer, reader = StepBroadcaster(spec, ctx), create_step_reader(spec, 0, ctx)
    try:
        rows = np.arange(4, dtype=np.int32)
        small = np.full((4, WORDS), 7, dtype=np.int32)
        writer.write_bitmask(StepBitmask(1, rows, small), timeout=5)
        frame = reader.read(timeout=5)
        header = codec.decode(frame)
        assert header.arena_buffer >= 0 and len(frame) < 200  # the rows stayed in the arena
        assert np.array_equal(reader.bitmask(header), small)
        big = np.full((6, WORDS), 9, dtype=np.int32)
        writer.write_bitmask(StepBitmask(2, np.arange(6, dtype=np.int32), big), timeout=5)
        whole = codec.decode(reader.read(timeout=5))
        assert whole.arena_buffer == -1 and np.array_equal(reader.bitmask(whole), big)
    finally:
        reader.close()
        writer.close()
        arena.close()
        ring.close()
        ctx.term()
