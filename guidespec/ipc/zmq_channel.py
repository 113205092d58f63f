"""ZeroMQ channels carrying codec frames: client <-> scheduler, workers -> scheduler, and
remote ring readers.

Local traffic uses ``ipc://`` paths under a per-engine directory; TCP endpoints are bound to
the address given, never ``*``. Receivers decode with ``guidespec.ipc.codec``; a frame that
does not decode is reported through ``on_malformed`` and dropped, and the receiver keeps going.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
from typing import Any, Callable

import zmq

from guidespec.ipc import codec

logger = logging.getLogger(__name__)


def new_ipc_endpoint(tag: str) -> str:
    """A fresh ``ipc://`` endpoint in the temp directory."""
    path = os.path.join(tempfile.gettempdir(), f"guidespec-{uuid.uuid4().hex[:12]}-{tag}")
    return f"ipc://{path}"


def check_bind_address(endpoint: str) -> None:
    if endpoint.startswith("tcp://") and ("*" in endpoint or "0.0.0.0" in endpoint):
        raise ValueError(f"refusing to bind {endpoint}: give an explicit interface address")


class Channel:
    """One ZeroMQ socket that sends and receives codec frames."""

    def __init__(self, ctx: zmq.Context, kind: int, endpoint: str, bind: bool) -> None:
        self.endpoint = endpoint
        self.socket = ctx.socket(kind)
        self.socket.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUSH:
            self.socket.setsockopt(zmq.SNDHWM, 0)
        if kind == zmq.PULL:
            self.socket.setsockopt(zmq.RCVHWM, 0)
        if bind:
            check_bind_address(endpoint)
            self.socket.bind(endpoint)
        else:
            self.socket.connect(endpoint)
        self.malformed_count = 0

    def send(self, message: Any) -> None:
        self.socket.send(codec.encode(message), copy=False)

    def recv(self, timeout_s: float | None = None, on_malformed: Callable[[str], None] | None = None) -> Any:
        """The next well-formed message, or None after ``timeout_s`` (None waits forever).

        The timeout runs from the call: malformed frames arriving now and then do not restart it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if deadline is not None and not self.socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                return None
            frame = self.socket.recv(copy=False)
            try:
                return codec.decode(frame.buffer)
            except codec.MalformedMessage as e:
                self.malformed_count += 1
                logger.warning("dropped a malformed frame on %s: %s", self.endpoint, e)
                if on_malformed is not None:
                    on_malformed(str(e))

    def recv_nowait(self) -> Any:
        return self.recv(timeout_s=0.0)

    def close(self) -> None:
        self.socket.close(linger=0)
