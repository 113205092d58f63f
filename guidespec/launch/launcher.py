"""Starting and stopping the engine's processes: one scheduler and N worker ranks.

Each process runs ``launch/child.py`` with its configuration as JSON (no pickle, no re-import
of the user's main module), forked by the client's zygote (``launch/zygote.py``) or started
as a new interpreter, in a session of its own so a terminal's
Ctrl-C reaches only the client, which then shuts the engine down. The launcher owns every
shared resource it creates (the ring's shared memory, the ipc socket files) and removes them
on ``shutdown`` whatever state the processes are in: it asks them to stop, waits briefly,
then kills. A monitor thread watches every process; when one dies it calls ``on_death`` with a
message naming it, so the client can fail in-flight requests at once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import secrets
import signal
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from guidespec import envs
from guidespec.bitmask import bitmask_width
from guidespec.config import MODEL_DRAFTERS, EngineConfig, SchedulerConfig, WorkerConfig, config_to_dict
from guidespec.cuda_ext.channel import ChannelLayout, DraftChannel
from guidespec.cuda_ext.channel import available as channel_available
from guidespec.ipc.broadcast import BroadcastLayout
from guidespec.ipc.collectives import CollectivesLayout, ShmCollectives
from guidespec.ipc.mask_arena import ArenaLayout, MaskArena
from guidespec.ipc.shm_ring import ShmRing
from guidespec.ipc.zmq_channel import new_ipc_endpoint
from guidespec.process_utils import kill_group
from guidespec.launch.zygote import EngineProcess, spawn_engine_process

logger = logging.getLogger(__name__)
_RING_SLOTS = 16
_RING_SLOT_SIZE = 1 << 20
# a rank's part of a collective in shared memory: a decode step's all-reduces and the LM head's
# gather of ~40 rows of the default model at TP=2 (larger ones, long prefills' all-reduces, go over gloo)
_COLLECTIVE_SLOT = 4 << 20
_MONITOR_INTERVAL_S = 0.05


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
        if 0 in cfg.remote_ranks or any(not 0 <= r < cfg.tensor_parallel_size for r in cfg.remote_ranks):
            raise ValueError(f"remote_ranks must be among ranks 1..{cfg.tensor_parallel_size - 1}")
        # a GPU rank's torch work on the host is a handful of tiny ops a step: one thread, no OpenMP
        # team to wake (measured on an H100: a 16-element op waited 3 ms for its team's threads)
        cores = max(1, (os.cpu_count() or 1) // cfg.tensor_parallel_size)
        self.threads = envs.worker_threads() or (1 if cfg.device == "cuda" else cores)
        self.ray = None
        host = "127.0.0.1"
        if cfg.distributed_executor == "ray":  # every rank an actor: the broadcast and results go over TCP
            from guidespec.launch.ray_executor import RayRanks

            self.ray = RayRanks(
                cfg.tensor_parallel_size,
                self.threads,
                cfg.ray_address,
                envs.ray_placement_timeout_s(),
                num_gpus=1 if cfg.device == "cuda" else 0,
                placement=cfg.ray_placement,
            )
            host = self.ray.driver_address()
            self.endpoints = dataclasses.replace(self.endpoints, worker_results=f"tcp://{host}:{_free_port(host)}")
            self.local_ranks: list[int] = []
        else:
            self.local_ranks = [r for r in range(cfg.tensor_parallel_size) if r not in cfg.remote_ranks]
        num_remote = cfg.tensor_parallel_size - len(self.local_ranks)
        self.ring = (
            ShmRing.create(f"guidespec-{uuid.uuid4().hex[:12]}", len(self.local_ranks), _RING_SLOTS, _RING_SLOT_SIZE)
            if self.local_ranks
            else None
        )
        remote = f"tcp://{host}:{_free_port(host)}" if num_remote else None
        self.arena = MaskArena.create(_arena_spec(cfg)) if self.local_ranks and cfg.vocab_size else None
        self.broadcast = BroadcastLayout(
            self.ring.layout if self.ring is not None else None,
            remote,
            secrets.token_hex(32),
            num_remote,
            self.arena.layout if self.arena is not None else None,
        )
        self.collectives = (
            ShmCollectives.create(
                CollectivesLayout(f"guidespec-{uuid.uuid4().hex[:12]}-tp", cfg.tensor_parallel_size, _COLLECTIVE_SLOT)
            )
            if _shared_collectives(cfg, self.local_ranks)
            else None
        )
        # model drafts and their masks between rank 0 and the scheduler (cuda_ext), where rank 0 is local
        self.drafts = DraftChannel.create(_channel_spec(cfg)) if _uses_channel(cfg, self.local_ranks) else None
        self.processes: dict[str, EngineProcess] = {}
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None

    def start(self) -> None:
        cfg, ep = self.cfg, self.endpoints
        # whole steps of a model drafter as one graph each (worker/drafting/step_graph.py): draft graphs on, every
        # rank local (they decide alike from the same step inputs and mask arena, whose rows the
        # draft channel holds too)
        fused = (
            self.drafts is not None
            and self.arena is not None
            and _draft_graphs(cfg)
            and not cfg.remote_ranks
            and envs.fused_steps()
        )
        scheduler_cfg = SchedulerConfig(
            cfg.model_dir,
            cfg.max_batch_size,
            cfg.max_model_len,
            cfg.max_num_batched_tokens,
            cfg.eos_token_ids,
            cfg.tensor_parallel_size,
            self.broadcast,
            ep.client_in,
            ep.client_out,
            ep.worker_results,
            cfg.vocab_size,
            cfg.grammar_backend,
            cfg.grammar_compile_timeout_s,
            cfg.jump_forward,
            cfg.speculative,
            cfg.enable_prefix_caching,
            draft_channel=self.drafts.layout if self.drafts is not None else None,
            grammar_fill_threads=cfg.grammar_fill_threads,
            fused_steps=fused,
            kv_block_size=cfg.kv_block_size,
            async_scheduling=envs.async_scheduling(),
            grammar_cache_dir=cfg.grammar_cache_dir,
        )
        self._spawn("scheduler", "scheduler", scheduler_cfg)
        init_method = self.ray.rank0_rendezvous() if self.ray is not None else f"tcp://127.0.0.1:{_free_port()}"
        worker_cfgs = [
            WorkerConfig(
                cfg.model_dir,
                cfg.dtype,
                rank,
                cfg.tensor_parallel_size,
                cfg.max_batch_size,
                cfg.max_model_len,
                self.broadcast,
                self._ring_index(rank),
                ep.worker_results,
                init_method,
                self.threads,
                cfg.show_progress,
                draft_model=_draft_model(cfg) if rank == 0 else None,
                draft_method=cfg.speculative.method if cfg.speculative else "draft_model",
                hf_config=cfg.hf_config,
                enforce_eager=cfg.enforce_eager,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                # rank i on cuda:i locally; a Ray rank on the one GPU Ray gave it
                device=_rank_device(cfg.device, None if self.ray is not None else rank),
                draft_channel=self.drafts.layout if self.drafts is not None and rank == 0 else None,
                scheduler_pid=self.processes["scheduler"].pid,
                quantized_weights=cfg.quantized_weights,
                draft_graphs=rank == 0 and self.drafts is not None and _draft_graphs(cfg),
                fused_steps=fused,
                kv_block_size=cfg.kv_block_size,
                kv_cache_tokens=cfg.kv_cache_tokens,
                collectives=self.collectives.layout if self.collectives is not None else None,
            )
            for rank in range(cfg.tensor_parallel_size)
        ]
        if self.ray is not None:
            self.ray.start(worker_cfgs)
        else:
            for worker_cfg in worker_cfgs:
                self._spawn(f"worker rank {worker_cfg.rank}", "worker", worker_cfg)
        self._monitor = threading.Thread(target=self._watch, name="guidespec-monitor", daemon=True)
        self._monitor.start()

    def _ring_index(self, rank: int) -> int | None:
        return self.local_ranks.index(rank) if rank in self.local_ranks else None

    def first_dead(self) -> str | None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                return _death_message(name, process)
        return self.ray.first_dead() if self.ray is not None else None

    def shutdown(self, grace_s: float = 3.0) -> None:
        self._stopping.set()
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(timeout=5.0)
            kill_group(process.pid)  # what it started, if still there (the compile process dies with the scheduler)
        if self.ray is not None:
            self.ray.close(grace_s=max(0.0, deadline - time.monotonic()))
        if self.ring is not None:
            self.ring.close()
        if self.arena is not None:
            self.arena.close()
        if self.drafts is not None:
            self.drafts.close()
        if self.collectives is not None:
            self.collectives.close()
        for endpoint in (self.endpoints.client_in, self.endpoints.client_out, self.endpoints.worker_results):
            path = endpoint.removeprefix("ipc://")
            if endpoint.startswith("ipc://") and os.path.exists(path):
                os.unlink(path)

    def _spawn(self, name: str, role: str, config: SchedulerConfig | WorkerConfig) -> None:
        job = {"role": role, "parent_pid": os.getpid(), "config": config_to_dict(config)}
        self.processes[name] = spawn_engine_process(job, self.cfg.device)

    def _watch(self) -> None:
        while not self._stopping.wait(_MONITOR_INTERVAL_S):
            dead = self.first_dead()
            if dead is not None and not self._stopping.is_set():
                self.on_death(dead)
                return


def _shared_collectives(cfg: EngineConfig, local_ranks: list[int]) -> bool:
    """Whether the ranks' collectives go through shared memory (``ipc/collectives.py``): CPU ranks,
    every one local (not under Ray, none remote), on x86-64 (its store order), unless
    ``GUIDESPEC_TP_SHM=0``."""
    return (
        cfg.device == "cpu"
        and cfg.tensor_parallel_size > 1
        and len(local_ranks) == cfg.tensor_parallel_size
        and platform.machine() in ("x86_64", "AMD64")
        and envs.tp_shared_memory()
    )


def _arena_spec(cfg: EngineConfig) -> ArenaLayout:
    """Room for every row of a full batch verifying the engine's draft length (a step with more
    rows, e.g. long forced drafts, sends its mask through the ring instead)."""
    rows_per_request = 1 + (cfg.speculative.max_draft_len if cfg.speculative is not None else 0)
    return ArenaLayout(
        f"guidespec-{uuid.uuid4().hex[:12]}-masks", cfg.max_batch_size * rows_per_request, bitmask_width(cfg.vocab_size)
    )


def _draft_graphs(cfg: EngineConfig) -> bool:
    """A model drafter's (EAGLE head, draft model) draft steps as graphs: by default on CUDA with
    graphs; ``graph_grammar`` True or False decides (on the CPU the same steps run eagerly;
    --enforce-eager wins on CUDA)."""
    if cfg.speculative is None or cfg.speculative.method not in MODEL_DRAFTERS:
        return False
    if cfg.device == "cuda" and cfg.enforce_eager:
        return False
    return cfg.device == "cuda" if cfg.graph_grammar is None else cfg.graph_grammar


_GPU_SPIN_US = 500  # how long a draft-channel waiter spins before it sleeps, beside a GPU


def _uses_channel(cfg: EngineConfig, local_ranks: list[int]) -> bool:
    """A model drafter on a local rank 0, the C library built, and the channel not switched off."""
    spec = cfg.speculative
    return (
        spec is not None
        and spec.method in MODEL_DRAFTERS
        and 0 in local_ranks
        and bool(cfg.vocab_size)
        and envs.draft_channel() != "python"
        and channel_available()
    )


def _channel_spec(cfg: EngineConfig) -> ChannelLayout:
    spin_us = envs.draft_spin_us()
    return ChannelLayout(
        f"guidespec-{uuid.uuid4().hex[:12]}-drafts",
        _arena_spec(cfg).num_rows,  # a draft step's rows, or a fused step's verify masks
        cfg.max_batch_size * 128,
        bitmask_width(cfg.vocab_size),
        # beside a GPU the host has cores to spare and a draft step's round trip is the latency
        # that counts; on the CPU the waiting side would take a core from the model
        (_GPU_SPIN_US if cfg.device == "cuda" else 0) if spin_us is None else spin_us,
    )


def _death_message(name: str, process: EngineProcess) -> str:
    code = process.returncode
    if code is not None and code < 0:
        how = f"was killed by signal {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    return f"{name} (pid {process.pid}) {how}"


def _draft_model(cfg: EngineConfig) -> str | None:
    spec = cfg.speculative
    return spec.draft_model if spec is not None and spec.method in MODEL_DRAFTERS else None


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _rank_device(device: str, rank: int | None) -> str:
    """``worker.device.rank_device``, imported when a rank is started: importing it imports torch
    (1.5 s), which ``import guidespec.llm`` leaves to ``LLM()``, after its zygote has started
    (``zygote.warm_up_before_torch``)."""
    from guidespec.worker.device import rank_device

    return rank_device(device, rank)
