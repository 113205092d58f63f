"""The scheduler's watch on the other processes: the workers' start, their liveness, the client's.

A worker that reports an error or whose process disappears raises ``EngineFailure``: every
request fails with its message and the client is told the engine is dead. A client that is
gone only stops the loop (``Health.stopping``): there is no one left to answer.
"""

from __future__ import annotations

import logging
import time

from guidespec import envs
from guidespec.ipc.zmq_channel import Channel
from guidespec.process_utils import parent_alive, process_alive
from guidespec.protocol import WorkerError, WorkerReady

logger = logging.getLogger(__name__)


class EngineFailure(RuntimeError):
    """The workers can no longer serve: every request fails with this message."""


class Health:
    """The workers' pids, the client's, and whether the loop is to stop."""

    def __init__(self, parent_pid: int) -> None:
        self.parent_pid = parent_pid
        self.worker_pids: dict[int, int] = {}
        self.kv_blocks: dict[int, int] = {}  # each rank's KV pool, in blocks (WorkerReady)
        self.stopping = False  # the client said Shutdown, or is gone

    def wait_for_workers(self, worker_results: Channel, num_workers: int, deadline: float, poll_s: float) -> None:
        """Every rank's ``WorkerReady`` before ``deadline`` (``time.monotonic()``)."""
        while len(self.worker_pids) < num_workers:
            message = worker_results.recv(timeout_s=poll_s)
            if isinstance(message, WorkerReady):
                self.worker_pids[message.rank] = message.pid
                self.kv_blocks[message.rank] = message.num_kv_blocks
            elif isinstance(message, WorkerError):
                raise EngineFailure(worker_failure(message))
            if time.monotonic() > deadline:
                raise EngineFailure(f"workers did not start within {envs.worker_start_timeout_s():.0f} s")
            if not parent_alive(self.parent_pid):
                raise EngineFailure("the client process is gone")

    def check(self) -> None:
        """Raise ``EngineFailure`` for a dead worker; stop the loop if the client is gone."""
        if self.stopping:  # the workers were told to stop: their exit is no failure
            return
        for rank, pid in self.worker_pids.items():
            if not process_alive(pid):
                raise EngineFailure(f"worker rank {rank} (pid {pid}) died")
        if not parent_alive(self.parent_pid):
            self.stopping = True


def worker_failure(message: WorkerError) -> str:
    """A worker's failure for the clients: one line; its traceback goes to this log."""
    if message.details:
        logger.error("worker rank %d failed at step %d:\n%s", message.rank, message.step, message.details)
    return message.message.splitlines()[0] if message.message else f"worker rank {message.rank} failed"
