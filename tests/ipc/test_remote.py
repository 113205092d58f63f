"""Remote readers over ZeroMQ TCP on 127.0.0.1, with real reader processes."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os

import pytest
import zmq

from guidespec import protocol
from guidespec.ipc import codec
from guidespec.ipc.remote import RemoteReader, RemoteWriter, reader_topic
from guidespec.ipc.shm_ring import RingTimeout

KEY = b"k" * 32


def _remote_reader_main(endpoint: str, key: bytes, count: int, results: mp.Queue) -> None:
    ctx = zmq.Context()
    reader = RemoteReader(ctx, endpoint, key)
    got = []
    try:
        for _ in range(count):
            got.append(hashlib.sha256(reader.read(timeout=20)).hexdigest())
    except RingTimeout:
        pass
    results.put((got, reader.rejected))
    reader.close()
    ctx.term()


def test_two_remote_readers_get_every_message() -> None:
    ctx = zmq.Context()
    writer = RemoteWriter(ctx, "tcp://127.0.0.1:0", KEY)
    payloads = [os.urandom(n) for n in (0, 10, 100_000, 3_000_000, 7)]
    spawn = mp.get_context("spawn")
    results: mp.Queue = spawn.Queue()
    readers = [
        spawn.Process(target=_remote_reader_main, args=(writer.endpoint, KEY, len(payloads), results)) for _ in range(2)
    ]
    for p in readers:
        p.start()
    writer.wait_for_readers(2, timeout=60)
    for payload in payloads:
        writer.write(payload)
    expected = [hashlib.sha256(p).hexdigest() for p in payloads]
    for _ in readers:
        got, rejected = results.get(timeout=60)
        assert got == expected and rejected == 0
    for p in readers:
        p.join(10)
    writer.close()
    ctx.term()


def test_frames_signed_with_another_key_are_rejected() -> None:
    """A sender that learnt the topic (it travels in the clear) but not the key: its frames are
    dropped and counted."""
    ctx = zmq.Context()
    impostor = RemoteWriter(ctx, "tcp://127.0.0.1:0", b"x" * 32)
    impostor.topic = reader_topic(KEY)  # sniffed
    reader = RemoteReader(ctx, impostor.endpoint, KEY)
    impostor.wait_for_readers(1, timeout=10)
    impostor.write(codec.encode(protocol.Shutdown("forged")))
    with pytest.raises(RingTimeout):
        reader.read(timeout=0.5)
    assert reader.rejected == 1
    reader.close()
    impostor.close()
    ctx.term()


def test_a_stranger_who_subscribes_first_does_not_count_as_a_reader() -> None:
    ctx = zmq.Context()
    writer = RemoteWriter(ctx, "tcp://127.0.0.1:0", KEY)
    stranger = ctx.socket(zmq.SUB)
    stranger.setsockopt(zmq.SUBSCRIBE, b"")
    stranger.connect(writer.endpoint)
    with pytest.raises(RingTimeout, match="0 of 1 remote readers"):
        writer.wait_for_readers(1, timeout=0.5)
    reader = RemoteReader(ctx, writer.endpoint, KEY)
    writer.wait_for_readers(1, timeout=10)
    writer.write(b"step")
    assert reader.read(timeout=5) == b"step"
    for socket in (stranger, reader):
        socket.close()
    writer.close()
    ctx.term()


def test_refuses_wildcard_bind_and_short_keys() -> None:
    ctx = zmq.Context()
    with pytest.raises(ValueError, match="explicit interface"):
        RemoteWriter(ctx, "tcp://*:5555", KEY)
    with pytest.raises(ValueError, match="16 bytes"):
        RemoteWriter(ctx, "tcp://127.0.0.1:0", b"short")
    ctx.term()


def test_writer_times_out_when_readers_do_not_join() -> None:
    ctx = zmq.Context()
    writer = RemoteWriter(ctx, "tcp://127.0.0.1:0", KEY)
    with pytest.raises(RingTimeout, match="0 of 1 remote readers"):
        writer.wait_for_readers(1, timeout=0.3)
    writer.close()
    ctx.term()
