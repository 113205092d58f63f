"""Futex bells (guidespec/ipc/futex.py): a sleeper wakes when the bell rings, not at its timeout."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from guidespec.ipc import futex
from guidespec.ipc.shm_ring import ShmRing

pytestmark = pytest.mark.skipif(not futex.available(), reason="no futex on this platform: rings poll instead")


def test_a_sleeper_wakes_when_the_bell_rings_and_not_when_it_already_rang() -> None:
    bell = np.zeros(1, dtype=np.uint32)
    address = int(bell.ctypes.data)
    start = time.monotonic()
    futex.wait(address, 7, 30.0)  # the bell holds 0, not 7: no sleep at all
    assert time.monotonic() - start < 10.0

    woke = threading.Event()

    def sleeper() -> None:
        futex.wait(address, 0, 30.0)
        woke.set()

    thread = threading.Thread(target=sleeper, daemon=True)
    thread.start()
    time.sleep(0.2)
    assert not woke.is_set()  # asleep on the bell
    np.add(bell, 1, out=bell)
    futex.wake(address)
    assert woke.wait(10.0)  # long before its 30 s timeout


def test_a_ring_reader_asleep_on_the_bell_gets_the_message() -> None:
    ring = ShmRing.create(f"guidespec-test-bell-{time.monotonic_ns()}", 1, num_slots=4, slot_size=64)
    try:
        reader, writer = ring.reader(0), ring.writer()
        got: list[bytes] = []
        thread = threading.Thread(target=lambda: got.append(reader.read(timeout=30.0)), daemon=True)
        thread.start()
        time.sleep(0.2)  # past the spin: asleep on the bell
        writer.write(b"x" * 100)  # two chunks, each rings
        thread.join(10.0)
        assert got == [b"x" * 100] and int(ring.bell[0]) == 2
    finally:
        ring.close()
