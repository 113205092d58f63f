"""The bitmask hand-off, scheduler to workers: one step's mask written, then read by every rank.

    python benchmarks/bitmask_broadcast.py [--rows 64] [--vocab 49152] [--readers 2] [--iterations 500]

Three ways, side by side in one run: through the ring (the mask encoded into the message, copied
into ring slots, reassembled by each reader); through the mask arena, copied in once (the ring
carries the header; each reader takes a view); and through the arena filled in place (the
scheduler's way: the grammar writes the rows into the arena's buffer, nothing is copied). Reported: p50 / p90 of the
write, of one reader's read (read, decode, the rows as an array), and of the hand-off (the
write plus every reader's read). Goal P6: the hand-off of 64 rows x 49,152 tokens to 2 readers
at p50 <= 30 us. Readers run in this process one after the other, so this is the cost of each
side, not a cross-process latency.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from guidespec.ipc import codec  # noqa: E402
from guidespec.ipc.broadcast import BroadcastLayout, StepBroadcaster, create_step_reader  # noqa: E402
from guidespec.ipc.mask_arena import ArenaLayout, MaskArena  # noqa: E402
from guidespec.ipc.shm_ring import ShmRing  # noqa: E402
from guidespec.protocol import StepBitmask  # noqa: E402


def measure(
    rows: int, vocab: int, readers: int, iterations: int, use_arena: bool, in_place: bool = False
) -> dict[str, np.ndarray]:
    words = -(-vocab // 32)
    ring = ShmRing.create(f"guidespec-bench-{uuid.uuid4().hex[:8]}", readers, 16, 1 << 20)
    arena = (
        MaskArena.create(ArenaLayout(f"guidespec-bench-{uuid.uuid4().hex[:8]}-masks", rows, words))
        if use_arena
        else None
    )
    ctx = zmq.Context()
    spec = BroadcastLayout(ring.layout, arena=arena.layout if arena is not None else None)
    writer = StepBroadcaster(spec, ctx)
    step_readers = [create_step_reader(spec, i, ctx) for i in range(readers)]
    bitmask = np.random.default_rng(0).integers(0, 2**31, (rows, words), dtype=np.int64).astype(np.int32)
    row_map = np.arange(rows, dtype=np.int32)
    writes, reads = [], []
    try:
        for step in range(iterations):
            mask = bitmask
            if in_place:  # the grammar fills the arena's buffer itself (not timed: it fills either way)
                buffer = writer.reserve_bitmask()
                assert buffer is not None
                buffer[:rows] = bitmask
                mask = buffer[:rows]
            start = time.perf_counter()
            writer.write_bitmask(StepBitmask(step, row_map, mask), timeout=5)
            writes.append(time.perf_counter() - start)
            for reader in step_readers:
                start = time.perf_counter()
                message = codec.decode(reader.read(timeout=5))
                rows_read = reader.bitmask(message)
                reads.append(time.perf_counter() - start)
                assert rows_read.shape == bitmask.shape
    finally:
        for reader in step_readers:
            reader.close()
        writer.close()
        if arena is not None:
            arena.close()
        ring.close()
        ctx.term()
    write, read = np.array(writes) * 1e6, np.array(reads) * 1e6
    return {"write": write, "read": read, "hand-off": write + read.reshape(iterations, readers).sum(axis=1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=500)
    args = parser.parse_args()
    size_kb = args.rows * -(-args.vocab // 32) * 4 / 1024
    print(
        f"{args.rows} rows x {args.vocab} tokens ({size_kb:.0f} KB) to {args.readers} readers, "
        f"{args.iterations} steps; microseconds"
    )
    print("| path | write p50 | write p90 | one read p50 | one read p90 | hand-off p50 | hand-off p90 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, use_arena, in_place in (
        ("ring (whole message)", False, False),
        ("arena, copied in (header on the ring)", True, False),
        ("arena, filled in place (the scheduler's way)", True, True),
    ):
        t = measure(args.rows, args.vocab, args.readers, args.iterations, use_arena, in_place)
        cells = [f"{np.percentile(t[k], q):.1f}" for k in ("write", "read", "hand-off") for q in (50, 90)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
