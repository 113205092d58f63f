"""The shared-memory ring with real reader processes."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
import uuid

import numpy as np
import pytest

from guidespec import protocol
from guidespec.ipc import codec
from guidespec.ipc.shm_ring import RingLayout, RingTimeout, ShmRing


def _reader_main(spec: RingLayout, index: int, count: int, results: mp.Queue, delay_s: float = 0.0) -> None:
    ring = ShmRing.attach(spec)
    reader = ring.reader(index)
    digests = []
    for _ in range(count):
        payload = reader.read(timeout=20)
        digests.append(hashlib.sha256(payload).hexdigest())
        time.sleep(delay_s)
    results.put((index, digests))
    ring.close()


def _payloads(count: int, max_size: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, int(rng.integers(0, max_size)), dtype=np.uint8).tobytes() for _ in range(count)]


@pytest.fixture
def ring_name() -> str:
    return f"gs-test-{uuid.uuid4().hex[:10]}"


@pytest.mark.parametrize("max_size", [100, 5000], ids=["small-wraparound", "multi-slot-messages"])
def test_two_readers_see_every_message_in_order(ring_name: str, max_size: int) -> None:
    ring = ShmRing.create(ring_name, num_readers=2, num_slots=4, slot_size=1024)
    payloads = _payloads(200, max_size)  # 200 messages through 4 slots: many wrap-arounds
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    readers = [ctx.Process(target=_reader_main, args=(ring.layout, i, len(payloads), results, 0.0)) for i in range(2)]
    for p in readers:
        p.start()
    writer = ring.writer()
    for payload in payloads:
        writer.write(payload, timeout=20)
    got = dict(results.get(timeout=60) for _ in readers)
    for p in readers:
        p.join(10)
    ring.close()
    expected = [hashlib.sha256(p).hexdigest() for p in payloads]
    assert got[0] == expected and got[1] == expected


def test_message_much_larger_than_the_ring(ring_name: str) -> None:
    ring = ShmRing.create(ring_name, num_readers=1, num_slots=2, slot_size=4096)
    big = os.urandom(1_000_000)  # 245 slots' worth through 2 slots
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    reader = ctx.Process(target=_reader_main, args=(ring.layout, 0, 1, results))
    reader.start()
    ring.writer().write(big, timeout=20)
    _, digests = results.get(timeout=60)
    reader.join(10)
    ring.close()
    assert digests == [hashlib.sha256(big).hexdigest()]


def test_dead_reader_times_out_the_writer_then_can_be_dropped(ring_name: str) -> None:
    ring = ShmRing.create(ring_name, num_readers=2, num_slots=2, slot_size=64)
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    alive = ctx.Process(target=_reader_main, args=(ring.layout, 0, 6, results))
    dead = ctx.Process(target=_reader_main, args=(ring.layout, 1, 1, results))
    alive.start()
    dead.start()
    writer = ring.writer()
    writer.write(b"one", timeout=10)
    dead.join(20)  # reads one message, exits: it holds the writer back from now on
    writer.write(b"two", timeout=10)
    start = time.monotonic()
    with pytest.raises(RingTimeout, match=r"reader\(s\) \[1\]"):
        for i in range(10):
            writer.write(b"more", timeout=0.3)
    assert time.monotonic() - start < 5
    ring.mark_reader_dead(1)
    for _ in range(3):  # the live reader expects 6 messages: one, two, more, 3 x after
        writer.write(b"after", timeout=10)
    got = dict(results.get(timeout=30) for _ in range(2))
    alive.join(20)
    ring.close()
    assert len(got[0]) == 6 and got[0][-1] == hashlib.sha256(b"after").hexdigest()


def test_reader_times_out_without_a_writer(ring_name: str) -> None:
    ring = ShmRing.create(ring_name, num_readers=1, num_slots=4, slot_size=64)
    reader = ring.reader(0)
    start = time.monotonic()
    with pytest.raises(RingTimeout):
        reader.read(timeout=0.2)
    assert 0.15 < time.monotonic() - start < 2
    ring.close()


def test_a_read_timed_out_inside_a_message_goes_on_with_it_next_time(ring_name: str) -> None:
    """A message of three chunks through two slots: a read with no time to wait takes the two
    written, times out on the third (the writer waits for a free slot), and the next read returns
    the whole message, then the one after it."""
    import threading

    ring = ShmRing.create(ring_name, num_readers=1, num_slots=2, slot_size=64)
    reader, writer = ring.reader(0), ring.writer()
    first, second = os.urandom(150), os.urandom(40)
    thread = threading.Thread(target=lambda: [writer.write(p, timeout=20) for p in (first, second)])
    thread.start()
    deadline = time.monotonic() + 20
    while int(ring.slot_seq[1]) != 1:  # both slots written: the writer waits for the reader
        assert time.monotonic() < deadline
        time.sleep(0.001)
    with pytest.raises(RingTimeout):
        reader.read(timeout=0)
    assert reader.read(timeout=20) == first
    assert reader.read(timeout=20) == second
    thread.join(10)
    ring.close()


def test_malformed_frame_on_the_ring_is_rejected_and_the_reader_goes_on(ring_name: str) -> None:
    ring = ShmRing.create(ring_name, num_readers=1, num_slots=4, slot_size=256)
    writer, reader = ring.writer(), ring.reader(0)
    writer.write(b"\x05\x00\x00\x00garbage")
    writer.write(codec.encode(protocol.Shutdown("ok")))
    with pytest.raises(codec.MalformedMessage):
        codec.decode(reader.read(timeout=1))
    assert codec.decode(reader.read(timeout=1)) == protocol.Shutdown("ok")
    ring.close()


def test_owner_close_removes_the_segment(ring_name: str) -> None:
    ring = ShmRing.create(ring_name, num_readers=1)
    assert os.path.exists(f"/dev/shm/{ring_name}")
    ring.close()
    assert not os.path.exists(f"/dev/shm/{ring_name}")


def _timed_reader_main(spec: RingLayout, timeout: float, results: mp.Queue) -> None:
    ring = ShmRing.attach(spec)
    results.put("waiting")
    try:
        results.put(ring.reader(0).read(timeout=timeout))
    except RingTimeout as e:
        results.put(str(e))
    finally:
        ring.close()


def test_a_reader_paused_past_its_timeout_still_reads(ring_name: str) -> None:
    """A process stopped (SIGSTOP) for longer than its read timeout and resumed before the
    message comes does not time out: the timeout counts running time (``waiting.AwakeTimer``).
    The engine's processes can be paused together and resumed."""
    import signal

    ring = ShmRing.create(ring_name, num_readers=1, num_slots=4, slot_size=64)
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    child = ctx.Process(target=_timed_reader_main, args=(ring.layout, 3.0, results))
    child.start()
    try:
        assert results.get(timeout=60) == "waiting"
        time.sleep(0.5)  # in its read now
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(4.0)  # past its 3 s timeout in wall time
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.3)
        ring.writer().write(b"after the pause")
        assert results.get(timeout=10) == b"after the pause"
    finally:
        child.join(timeout=10)
        ring.close()
