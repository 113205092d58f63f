"""How soon a ring reader in another process sees a message: round trips through two rings.

    python benchmarks/ring_wake.py [--round-trips 1000] [--gaps-us 500 2000]

A child process echoes every message of one ring into another; the parent writes, reads the
echo, then stays busy for a gap (the scheduler's time between a worker's outputs and its next
inputs is about 1 ms). Three ways for the readers to wait, side by side: on the ring's futex
bell (the engine's), the sleep loop it replaced (doubling sleeps up to 1 ms), and spinning
(the lower bound, a core burnt per reader). Reported: the round trip's p50 and p90, and the
writer's own CPU time a write (the mean: thread CPU time, which a futex wake of a reader that has
fallen asleep adds to; on a VM that wake is an interrupt to another virtual core).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import guidespec.ipc.shm_ring as shm_ring  # noqa: E402
from benchmarks.common import machine  # noqa: E402
from guidespec.ipc import futex  # noqa: E402

WAYS = ("futex bell", "sleep loop", "spin")


def _wait_as(way: str) -> None:
    if way == "sleep loop":
        futex.available = lambda: False  # type: ignore[assignment]
    if way == "spin":
        shm_ring._SPIN_S = 1e9


def _echo(way: str, into: shm_ring.RingLayout, back: shm_ring.RingLayout, count: int) -> None:
    _wait_as(way)
    reader, writer = shm_ring.ShmRing.attach(into).reader(0), shm_ring.ShmRing.attach(back).writer()
    for _ in range(count):
        writer.write(reader.read(timeout=30.0))


def round_trips(way: str, count: int, gap_s: float) -> tuple[np.ndarray, float]:
    into = shm_ring.ShmRing.create(f"guidespec-wake-{uuid.uuid4().hex[:8]}", 1, 8, 4096)
    back = shm_ring.ShmRing.create(f"guidespec-wake-{uuid.uuid4().hex[:8]}", 1, 8, 4096)
    child = mp.get_context("spawn").Process(target=_echo, args=(way, into.layout, back.layout, count))
    child.start()
    try:
        writer, reader = into.writer(), back.reader(0)
        message, times, write_cpu = b"x" * 300, [], 0.0
        for _ in range(count):
            start, cpu = time.perf_counter(), time.thread_time()
            writer.write(message)
            write_cpu += time.thread_time() - cpu
            reader.read(timeout=30.0)
            times.append(time.perf_counter() - start)
            busy = time.perf_counter()
            while time.perf_counter() - busy < gap_s:
                pass
        child.join(30)
        return np.array(times), write_cpu / count
    finally:
        into.close()
        back.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--round-trips", type=int, default=1000)
    parser.add_argument("--gaps-us", type=int, nargs="+", default=[500, 2000])
    args = parser.parse_args()
    print(f"{machine()}; {args.round_trips} round trips of 300 bytes; futex available: {futex.available()}\n")
    print("| readers wait by | gap between round trips | round trip p50 µs | p90 µs | writer's CPU a write, µs |")
    print("|---|---:|---:|---:|---:|")
    for gap in args.gaps_us:
        for way in WAYS:
            if way == "futex bell" and not futex.available():
                continue
            saved = (futex.available, shm_ring._SPIN_S)
            _wait_as(way)
            try:
                times, write_cpu = round_trips(way, args.round_trips, gap / 1e6)
                times *= 1e6
            finally:
                futex.available, shm_ring._SPIN_S = saved  # type: ignore[assignment]
            p50, p90 = np.median(times), np.percentile(times, 90)
            print(f"| {way} | {gap} µs | {p50:.0f} | {p90:.0f} | {write_cpu * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
