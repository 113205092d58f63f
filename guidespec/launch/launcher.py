"""Starting and stopping the engine's processes: one scheduler and N worker ranks.

The launcher owns every shared resource it creates (the ring's shared memory, the ipc socket
files) and removes them on ``shutdown``, whatever state the processes are in: it asks them
to stop, waits briefly, then kills. A monitor thread watches every process; when one dies it
calls ``on_death`` with a message naming it, so the client can fail in-flight requests at once
instead of waiting for a step that will never finish.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Callable

from guidespec.config import EngineConfig, SchedulerConfig, WorkerConfig
from guidespec.ipc.shm_ring import ShmRing
from guidespec.ipc.zmq_channel import new_ipc_endpoint
from guidespec.scheduler.scheduler import run_scheduler
from guidespec.worker.worker import run_worker

logger = logging.getLogger(__name__)
_RING_SLOTS = 16
_RING_SLOT_SIZE = 1 << 20


@dataclass(frozen=True)
class Endpoints:
    client_in: str
    client_out: str
    worker_results: str


class EngineProcesses:
    def __init__(self, cfg: EngineConfig, on_death: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.on_death = on_death
        self.endpoints = Endpoints(*(new_ipc_endpoint(t) for t in ("in", "out", "results")))
        self.ring = ShmRing.create(f"guidespec-{uuid.uuid4().hex[:12]}", cfg.tensor_parallel_size,
                                   _RING_SLOTS, _RING_SLOT_SIZE)
        self.processes: dict[str, mp.process.BaseProcess] = {}
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        cfg, ep = self.cfg, self.endpoints
        parent = os.getpid()
        scheduler_cfg = SchedulerConfig(cfg.model_dir, cfg.max_batch_size, cfg.max_model_len, cfg.max_num_batched_tokens,
                                        cfg.eos_token_ids, cfg.tensor_parallel_size, self.ring.spec,
                                        ep.client_in, ep.client_out, ep.worker_results)
        self.processes["scheduler"] = ctx.Process(target=run_scheduler, args=(scheduler_cfg, parent),
                                                  name="guidespec-scheduler", daemon=True)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        threads = max(1, (os.cpu_count() or 1) // cfg.tensor_parallel_size)
        for rank in range(cfg.tensor_parallel_size):
            worker_cfg = WorkerConfig(cfg.model_dir, cfg.dtype, rank, cfg.tensor_parallel_size, cfg.max_batch_size,
                                      cfg.max_model_len, self.ring.spec, ep.worker_results, init_method, threads)
            self.processes[f"worker rank {rank}"] = ctx.Process(target=run_worker, args=(worker_cfg, parent),
                                                                name=f"guidespec-worker{rank}", daemon=True)
        for process in self.processes.values():
            process.start()
        self._monitor = threading.Thread(target=self._watch, name="guidespec-monitor", daemon=True)
        self._monitor.start()

    def first_dead(self) -> str | None:
        for name, process in self.processes.items():
            if process.exitcode is not None:
                return _death_message(name, process)
        return None

    def shutdown(self, grace_s: float = 3.0) -> None:
        self._stopping.set()
        for process in self.processes.values():
            process.join(timeout=grace_s)
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
                process.join(timeout=2.0)
        self.ring.close()
        for endpoint in (self.endpoints.client_in, self.endpoints.client_out, self.endpoints.worker_results):
            path = endpoint.removeprefix("ipc://")
            if os.path.exists(path):
                os.unlink(path)

    def _watch(self) -> None:
        sentinels = {p.sentinel: (name, p) for name, p in self.processes.items()}
        while not self._stopping.is_set():
            ready = wait(list(sentinels), timeout=0.2)
            if ready and not self._stopping.is_set():
                name, process = sentinels[ready[0]]  # type: ignore[index]
                process.join(timeout=0.1)
                self.on_death(_death_message(name, process))
                return


def _death_message(name: str, process: mp.process.BaseProcess) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        import signal

        how = f"was killed by signal {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    return f"{name} (pid {process.pid}) {how}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
