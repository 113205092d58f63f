"""Timeouts that count only the time the waiting process was running.

A wait that checks every few milliseconds sees a gap of seconds between two checks only when
its own process did not run: stopped (SIGSTOP, a debugger), a suspended VM, a starved machine.
That time says nothing of the peer it waits for, so ``AwakeTimer`` counts at most ``max_gap``
seconds of any one gap: the engine's processes can be paused together and resumed without
their step watchdogs declaring each other dead, and a peer that is really stuck is still
found after the timeout of running time.
"""

from __future__ import annotations

import time

MAX_GAP_S = 1.0


class AwakeTimer:
    def __init__(self, timeout: float | None, max_gap: float = MAX_GAP_S) -> None:
        self.timeout = timeout
        self.max_gap = max_gap
        self.waited = 0.0
        self._last = time.monotonic()

    def expired(self) -> bool:
        """Add the time since the last check (at most ``max_gap``); True once past the timeout."""
        now = time.monotonic()
        self.waited += min(now - self._last, self.max_gap)
        self._last = now
        return self.timeout is not None and self.waited >= self.timeout
