"""Broadcast to readers on other hosts over ZeroMQ, the remote twin of the shared-memory ring.

The writer binds an XPUB socket to an explicit TCP address (never ``*``) and waits until the
expected number of readers has subscribed, so no message is lost to a late joiner; it never
drops messages (no high-water mark). Readers subscribe to a topic derived from the key the
launcher hands them (HMAC of a fixed label), and only those subscriptions count: a stranger who
connects first cannot take a reader's place. Every frame is ``[topic, HMAC-SHA256, payload]``:
a reader drops, and counts, any frame whose signature does not match, so a stranger can neither
inject steps nor make a reader unpickle anything (nothing is ever unpickled: frames are codec
frames). The stream is signed, not encrypted: bind it to a private network.
"""

from __future__ import annotations

import hashlib
import hmac
import time

import zmq

from guidespec.ipc.shm_ring import RingTimeout
from guidespec.ipc.zmq_channel import check_bind_address

_MAC_LEN = 32


def reader_topic(key: bytes) -> bytes:
    """The subscription topic of the stream under ``key``: knowing it proves knowing the key."""
    return hmac.new(key, b"guidespec remote reader", hashlib.sha256).digest()


class RemoteWriter:
    def __init__(self, ctx: zmq.Context, endpoint: str, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("the authentication key must be at least 16 bytes")
        check_bind_address(endpoint)
        self.key = key
        self.topic = reader_topic(key)
        self.socket = ctx.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.socket.bind(endpoint)
        self.endpoint = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.num_subscribed = 0

    def wait_for_readers(self, count: int, timeout: float) -> None:
        """Block until ``count`` readers have subscribed."""
        deadline = time.monotonic() + timeout
        while self.num_subscribed < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.socket.poll(int(remaining * 1000)):
                raise RingTimeout(f"{self.num_subscribed} of {count} remote readers joined {self.endpoint} in time")
            event = self.socket.recv()
            if event == b"\x01" + self.topic:  # (a stranger's subscription, to anything else, does not count)
                self.num_subscribed += 1

    def write(self, payload: bytes) -> None:
        mac = hmac.new(self.key, payload, hashlib.sha256).digest()
        self.socket.send_multipart([self.topic, mac, payload], copy=False)

    def close(self) -> None:
        self.socket.close(linger=0)


class RemoteReader:
    def __init__(self, ctx: zmq.Context, endpoint: str, key: bytes) -> None:
        self.key = key
        self.socket = ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, reader_topic(key))
        self.socket.connect(endpoint)
        self.rejected = 0

    def read(self, timeout: float | None = 10.0) -> bytes:
        """The next authentic frame; frames with a bad signature are dropped and counted."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait_ms = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self.socket.poll(wait_ms):
                raise RingTimeout(f"no message from the remote writer in {timeout} s")
            parts = self.socket.recv_multipart()
            if (
                len(parts) == 3
                and len(parts[1]) == _MAC_LEN
                and hmac.compare_digest(parts[1], hmac.new(self.key, parts[2], hashlib.sha256).digest())
            ):
                return parts[2]
            self.rejected += 1

    def poll(self) -> bool:
        """True if a frame is waiting (it may still fail its signature check)."""
        return bool(self.socket.poll(0))

    def close(self) -> None:
        self.socket.close(linger=0)
