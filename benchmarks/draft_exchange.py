"""One draft step's hand-off between rank 0 and the scheduler, measured across two processes.

    python -m benchmarks.draft_exchange [--rows 8] [--vocab 49152] [--iterations 2000]

Rank 0 (this process) sends a draft step's token sequences and waits for one mask row per row;
the scheduler (a second process) answers with rows it already has (the grammar's fill is not
timed: it is the same on every path). Three paths, side by side in one run:

- ``c``: the cuda_ext draft channel, its C functions called directly (the CPU worker's default);
- ``host stream``: the same C functions run as host callbacks by the C host stream (what a CUDA
  stream replaying a graph calls), plus the hand-over to and from that thread;
- ``python``: the message path (``DraftTokens`` over ZeroMQ, ``DraftMask`` back through the
  shared-memory ring, msgpack both ways), used where rank 0 is not local.

Reported: p50 / p90 of the round trip in microseconds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from guidespec.cuda_ext.channel import DONE, ChannelLayout, DraftChannel, StreamExchange  # noqa: E402
from guidespec.ipc import codec  # noqa: E402
from guidespec.ipc.shm_ring import RingLayout, ShmRing  # noqa: E402
from guidespec.ipc.zmq_channel import Channel, new_ipc_endpoint  # noqa: E402
from guidespec.protocol import DraftMask, DraftTokens  # noqa: E402


def _answer_channel(spec: ChannelLayout, steps: int, ready: mp.Event, acks: Any) -> None:
    """The scheduler's side: every draft step of each step, until rank 0's DONE; then the ack that
    stands for the next step's broadcast (rank 0 drafts a step only after it was broadcast)."""
    channel = DraftChannel.attach(spec)
    mask = np.full((spec.max_rows, spec.num_words), -1, np.int32)
    ready.set()
    for step in range(steps):
        last = -1
        while True:
            got = channel.next_drafts(step, last, 30.0, 0)
            assert got is not None
            if got[0] == DONE:
                break
            channel.answer(step, got[0], mask[: len(got[1])])
            last = got[0]
        acks.send(step)
    channel.close()


_DRAFTS_PER_STEP = 20  # draft steps per step (a StreamExchange holds 32 argument blocks)


def _answer_messages(
    ring_spec: RingLayout, endpoint: str, rows: int, words: int, iterations: int, ready: mp.Event
) -> None:
    ring = ShmRing.attach(ring_spec)
    writer = ring.writer()
    ctx = zmq.Context()
    inbox = Channel(ctx, zmq.PULL, endpoint, bind=True)
    mask = np.full((rows, words), -1, np.int32)
    ready.set()
    for _ in range(iterations):
        message = inbox.recv(timeout_s=30.0)
        assert isinstance(message, DraftTokens)
        writer.write(codec.encode(DraftMask(message.step, message.draft_index, mask[: len(message.rows)])), 30.0)
    inbox.close()
    ctx.term()
    ring.close()


def _percentiles(times: list[float]) -> tuple[float, float]:
    us = np.array(times) * 1e6
    return float(np.percentile(us, 50)), float(np.percentile(us, 90))


def run(rows: int, vocab: int, iterations: int) -> dict[str, tuple[float, float]]:
    words = -(-vocab // 32)
    sequences = [[17, 42, 99, 3][: 1 + i % 4] for i in range(rows)]
    batch_rows = np.arange(rows, dtype=np.int32)
    spawn = mp.get_context("spawn")
    results = {}
    for path in ("c", "host stream"):
        spec = ChannelLayout(f"gs-bench-{uuid.uuid4().hex[:8]}", rows, rows * 16, words)
        channel = DraftChannel.create(spec)
        ready = spawn.Event()
        acks, peer_acks = spawn.Pipe(duplex=False)
        steps = -(-iterations // _DRAFTS_PER_STEP)
        peer = spawn.Process(target=_answer_channel, args=(spec, steps, ready, peer_acks), daemon=True)
        peer.start()
        ready.wait(60)
        exchange = StreamExchange(channel, 30.0, peer.pid) if path == "host stream" else None
        times = []
        for step in range(steps):
            for index in range(_DRAFTS_PER_STEP):
                start = time.perf_counter()
                if exchange is not None:
                    exchange.exchange(step, index, batch_rows, sequences)
                else:
                    channel.exchange(step, index, batch_rows, sequences, 30.0, peer.pid)
                times.append(time.perf_counter() - start)
            channel.done(step)
            acks.recv()
        peer.join(30)
        if exchange is not None:
            exchange.close()
        channel.close()
        results[path] = _percentiles(times)
    ring = ShmRing.create(f"gs-bench-{uuid.uuid4().hex[:8]}", 1, 16, 1 << 20)
    reader = ring.reader(0)
    endpoint = new_ipc_endpoint("bench")
    ready = spawn.Event()
    peer = spawn.Process(
        target=_answer_messages, args=(ring.layout, endpoint, rows, words, iterations, ready), daemon=True
    )
    peer.start()
    ready.wait(60)
    ctx = zmq.Context()
    outbox = Channel(ctx, zmq.PUSH, endpoint, bind=False)
    flat = np.array([t for s in sequences for t in s], np.int32)
    lens = np.array([len(s) for s in sequences], np.int32)
    times = []
    for step in range(iterations):
        start = time.perf_counter()
        outbox.send(DraftTokens(step, 0, batch_rows, flat, lens))
        message = codec.decode(reader.read(timeout=30.0))
        assert isinstance(message, DraftMask) and message.step == step
        times.append(time.perf_counter() - start)
    peer.join(30)
    outbox.close()
    ctx.term()
    ring.close()
    results["python"] = _percentiles(times)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--iterations", type=int, default=2000)
    args = parser.parse_args()
    results = run(args.rows, args.vocab, args.iterations)
    print(f"draft step round trip, {args.rows} rows x {args.vocab} vocabulary, {args.iterations} iterations")
    print("| path | p50 µs | p90 µs |\n|---|---:|---:|")
    for path, (p50, p90) in results.items():
        print(f"| {path} | {p50:.1f} | {p90:.1f} |")


if __name__ == "__main__":
    main()
