"""Fuzzing the shared-memory ring's framing and the signed ZeroMQ stream that stands in for it on
other hosts (issue 21).

A reader of a ring whose slot headers are corrupted must return a message, raise
``RingCorrupt``, or raise ``RingTimeout`` within its timeout: never an exception of numpy's,
never a hang, never an allocation sized by a corrupt length. Fuzzed, with hypothesis, every test
under ``@seed(21)`` (the issue's number) with no example database, so every run draws the same
cases:

- corrupted headers: after 0 to 16 messages written and read, 1 to 3 messages of 0 to 4.5
  slots written, then 1 to 4 header words (a slot's sequence number, length or total, or the
  reader's cursor) set to values around the limits (negative, a slot's size +- 1, 2**31,
  2**62, ...) or anywhere in int64, then up to 4 reads (250 examples);
- messages up to 5 times the whole ring (4 slots of 64 bytes), through a reader thread (60
  examples of 1 to 6 messages of 0 to 1,280 bytes);
- the remote stream: frames of 1 to 3 random parts (0 to 48 bytes), unsigned (dropped and
  counted) or signed by the writer (handed on whole: the codec refuses them); the next good
  frame comes through (40 examples).

Plus, exhaustively, every message size from 0 to the ring's capacity (0 to 8 slots of 64
bytes), each named corruption (a length past the slot, a negative length, a total that does
not match the chunks, sequence numbers out of order, a total of 2**62), and a message over
``MAX_MESSAGE_SIZE`` refused at write. About 3 s in all.
"""

from __future__ import annotations

import threading
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from guidespec import protocol
from guidespec.ipc import codec, shm_ring
from guidespec.ipc.remote import RemoteReader, RemoteWriter
from guidespec.ipc.shm_ring import MAX_MESSAGE_SIZE, RingCorrupt, RingTimeout, ShmRing

SEED = 21
SLOT = 64  # bytes per slot in every ring here
SLOTS = 8
READ_TIMEOUT_S = 0.01
KEY = b"k" * 32


def fuzz(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@contextmanager
def new_ring(num_slots: int = SLOTS) -> Iterator[ShmRing]:
    ring = ShmRing.create(f"gs-fuzz-{uuid.uuid4().hex[:10]}", num_readers=1, num_slots=num_slots, slot_size=SLOT)
    try:
        yield ring
    finally:
        ring.close()


def payload(size: int, salt: int = 0) -> bytes:
    return np.random.default_rng(size * 1000 + salt).integers(0, 256, size, dtype=np.uint8).tobytes()


def read_or_fail_cleanly(reader: shm_ring.RingReader, timeout: float = READ_TIMEOUT_S) -> bytes | Exception:
    """The message, or the RingCorrupt / RingTimeout raised (any other exception fails), in time."""
    start = time.monotonic()
    try:
        return reader.read(timeout=timeout)
    except (RingCorrupt, RingTimeout) as e:
        return e
    finally:
        assert time.monotonic() - start < timeout + 1.0


# ---------------------------------------------------------------- sizes


def test_every_size_up_to_the_ring_round_trips() -> None:
    with new_ring() as ring:
        writer, reader = ring.writer(), ring.reader(0)
        for size in range(SLOTS * SLOT + 1):
            writer.write(payload(size), timeout=1)
            assert reader.poll()
            assert reader.read(timeout=1) == payload(size)
            assert not reader.poll()


@seed(SEED)
@fuzz(60)
@given(st.lists(st.integers(0, 5 * 4 * SLOT), min_size=1, max_size=6))
def test_messages_larger_than_the_ring_round_trip(sizes: list[int]) -> None:
    with new_ring(num_slots=4) as ring:
        got: list[bytes | Exception] = []
        reader = threading.Thread(target=lambda: got.extend(read_or_fail_cleanly(ring.reader(0), 10) for _ in sizes))
        reader.start()
        writer = ring.writer()
        for i, size in enumerate(sizes):
            writer.write(payload(size, i), timeout=10)
        reader.join(20)
    assert got == [payload(size, i) for i, size in enumerate(sizes)]


def test_a_message_over_the_limit_is_refused_at_write(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_ring, "MAX_MESSAGE_SIZE", 3 * SLOT)
    with new_ring() as ring:
        writer, reader = ring.writer(), ring.reader(0)
        with pytest.raises(ValueError, match="over the limit"):
            writer.write(payload(3 * SLOT + 1), timeout=1)
        assert not reader.poll()  # nothing half-written
        writer.write(payload(3 * SLOT), timeout=1)
        assert reader.read(timeout=1) == payload(3 * SLOT)


# ---------------------------------------------------------------- corrupted headers


def _set(ring: ShmRing, slot: int, field: str, value: int) -> None:
    {"seq": ring.slot_seq, "nbytes": ring.slot_nbytes, "total": ring.slot_total}[field][slot] = value


NAMED_CORRUPTIONS = {  # on a 3-slot message in slots 0-2: (slot, field, value), what the reader must raise
    "length-past-the-slot": ((0, "nbytes", SLOT + 1), RingCorrupt),
    "huge-length": ((1, "nbytes", 2**62), RingCorrupt),
    "negative-length": ((0, "nbytes", -5), RingCorrupt),
    "short-middle-chunk": ((1, "nbytes", SLOT - 1), RingCorrupt),
    "negative-total": ((0, "total", -1), RingCorrupt),
    "total-below-the-first-chunk": ((0, "total", SLOT - 1), RingCorrupt),
    "total-over-the-chunks": ((0, "total", 3 * SLOT + 1), RingTimeout),  # waits for a fourth chunk
    "total-of-2**62": ((0, "total", 2**62), RingCorrupt),
    "new-message-inside-a-message": ((1, "total", SLOT), RingCorrupt),
    "sequence-from-a-later-lap": ((1, "seq", 1 + SLOTS), RingTimeout),
    "sequence-from-the-last-lap": ((2, "seq", 2 - SLOTS), RingTimeout),
}


@pytest.mark.parametrize("corruption, error", NAMED_CORRUPTIONS.values(), ids=NAMED_CORRUPTIONS.keys())
def test_named_corruptions_raise_a_ring_error_in_time(corruption: tuple[int, str, int], error: type) -> None:
    with new_ring() as ring:
        ring.writer().write(payload(3 * SLOT), timeout=1)
        _set(ring, *corruption)
        tracemalloc.start()
        try:
            outcome = read_or_fail_cleanly(ring.reader(0))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert isinstance(outcome, error), outcome
    assert peak < 1 << 20


EDGE_VALUES = [
    -(2**63),
    -(2**31),
    -SLOT,
    -2,
    -1,
    0,
    1,
    2,
    SLOT - 1,
    SLOT,
    SLOT + 1,
    2 * SLOT,
    16 * SLOT,
    2**31,
    2**62,
    2**63 - 1,
    MAX_MESSAGE_SIZE,
    MAX_MESSAGE_SIZE + 1,
]
CORRUPTION = st.tuples(
    st.integers(0, 15),
    st.sampled_from(["seq", "nbytes", "total", "cursor"]),
    st.sampled_from(EDGE_VALUES) | st.integers(-(2**63), 2**63 - 1),
)


@seed(SEED)
@fuzz(250)
@given(
    st.integers(0, 16),
    st.lists(st.integers(0, 9 * SLOT // 2), min_size=1, max_size=3),
    st.lists(CORRUPTION, min_size=1, max_size=4),
)
def test_corrupted_headers_give_a_message_or_a_ring_error(
    num_warmup: int, sizes: list[int], corruptions: list[tuple[int, str, int]]
) -> None:
    with new_ring(num_slots=16) as ring:  # 16 slots hold the 3 messages of up to 5 chunks unread
        writer, reader = ring.writer(), ring.reader(0)
        for _ in range(num_warmup):  # so the messages start anywhere in the ring
            writer.write(payload(SLOT), timeout=1)
            reader.read(timeout=1)
        for i, size in enumerate(sizes):
            writer.write(payload(size, i), timeout=1)
        for slot, field, value in corruptions:
            if field == "cursor":
                ring.cursors[0] = value
            else:
                _set(ring, slot, field, value)
        for _ in range(4):
            outcome = read_or_fail_cleanly(reader)
            if isinstance(outcome, Exception):
                break
            assert len(outcome) <= 16 * SLOT


# ---------------------------------------------------------------- the remote stream


@pytest.fixture(scope="module")
def remote_pair() -> Iterator[tuple[RemoteWriter, RemoteReader]]:
    ctx = zmq.Context()
    writer = RemoteWriter(ctx, "tcp://127.0.0.1:0", KEY)
    reader = RemoteReader(ctx, writer.endpoint, KEY)
    writer.wait_for_readers(1, timeout=10)
    yield writer, reader
    reader.close()
    writer.close()
    ctx.term()


@seed(SEED)
@fuzz(40)
@given(st.lists(st.binary(max_size=48), min_size=1, max_size=3), st.booleans())
def test_remote_reader_drops_unsigned_frames_and_hands_on_signed_ones(
    remote_pair: tuple[RemoteWriter, RemoteReader], parts: list[bytes], signed: bool
) -> None:
    writer, reader = remote_pair
    rejected = reader.rejected
    if signed:
        writer.write(parts[-1])  # garbage the scheduler (or a bug) signed: the codec refuses it later
    else:
        writer.socket.send_multipart([writer.topic, *parts])  # behind the topic, which a sniffer could learn
    writer.write(codec.encode(protocol.Shutdown("after the garbage")))
    if signed:
        assert reader.read(timeout=5) == parts[-1]
    assert codec.decode(reader.read(timeout=5)) == protocol.Shutdown("after the garbage")
    assert reader.rejected - rejected == (0 if signed else 1)
