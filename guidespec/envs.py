"""Every environment variable guidespec reads, typed, in one place (prefix ``GUIDESPEC_``).

No other module calls ``os.getenv``; they import the accessor from here.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted model copies and read model configs are kept (``GUIDESPEC_CACHE_DIR``)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "guidespec"
    return Path(os.environ.get("GUIDESPEC_CACHE_DIR", default))


def worker_start_timeout_s() -> float:
    """How long the launcher waits for every process to report ready (``GUIDESPEC_START_TIMEOUT_S``)."""
    return float(os.environ.get("GUIDESPEC_START_TIMEOUT_S", "300"))


def step_timeout_s() -> float:
    """How long the scheduler waits for a step's outputs (running time) before declaring the
    workers stuck. A dead worker is found at once by its exit; this is for a hung one. 600 s: on
    a busy 2-core CPU, one prefill step of an 8k-token prompt took over 120 s (the sweep's engine
    was declared dead)."""
    return float(os.environ.get("GUIDESPEC_STEP_TIMEOUT_S", "600"))


def log_level() -> str:
    return os.environ.get("GUIDESPEC_LOG_LEVEL", "WARNING").upper()


def cpu_kernels_enabled() -> bool:
    """``GUIDESPEC_CPU_KERNELS=0`` turns off the compiled CPU kernels (torch is used instead) and
    early closing's compiled narrowing (NumPy is)."""
    return os.environ.get("GUIDESPEC_CPU_KERNELS", "1") != "0"


def kernel_spin_us() -> int:
    """``GUIDESPEC_KERNEL_SPIN_US=N``: how long the CPU kernels' helper threads spin after a
    parallel region before they sleep, unless the worker parks them first (``pool.c``; default 1000)."""
    value = int(os.environ.get("GUIDESPEC_KERNEL_SPIN_US", "1000"))
    if value < 0:
        raise ValueError(f"GUIDESPEC_KERNEL_SPIN_US must be >= 0, got {value}")
    return value


def amx() -> bool:
    """``GUIDESPEC_AMX=0``: the CPU kernels' checked greedy picks sum with AVX-512 VNNI even where
    the CPU has AMX tiles and Linux grants them (``packed_linear.c``)."""
    return os.environ.get("GUIDESPEC_AMX", "1") != "0"


def core_share() -> bool:
    """``GUIDESPEC_CORE_SHARE=0``: a CPU rank 0 whose kernels take every core keeps its whole team
    for masked steps' forwards even while they wait for their masks (``worker/core_share.py``)."""
    return os.environ.get("GUIDESPEC_CORE_SHARE", "1") != "0"


def trace_path() -> str | None:
    """``GUIDESPEC_TRACE=FILE``: the scheduler writes a Chrome trace of every step there at shutdown."""
    return os.environ.get("GUIDESPEC_TRACE") or None


def torch_profiler_dir() -> str | None:
    """``GUIDESPEC_TORCH_PROFILER_DIR=DIR``: rank 0 runs torch's profiler (CPU and CUDA) over the
    steps during which the file ``DIR/on`` exists, and writes each such window's Chrome trace to
    ``DIR/rank0-<n>.json`` when the file goes away (one existence check per step otherwise)."""
    return os.environ.get("GUIDESPEC_TORCH_PROFILER_DIR") or None


def tp_backend() -> str | None:
    """The collective backend of tensor-parallel ranks (``GUIDESPEC_TP_BACKEND``): unset, NCCL on
    CUDA and gloo on the CPU (``worker.collective_backend``). ``gloo`` on CUDA passes the ranks'
    CUDA tensors through host memory, so ranks may share a GPU, which NCCL refuses: rank i on
    ``cuda:(i mod GPUs)``, eagerly (gloo's collectives wait on the host, which a CUDA graph cannot
    hold). It is the stand-in for NCCL that runs the GPU's tensor-parallel path (placement,
    sharded weights, collectives of CUDA tensors) on one GPU, slowly; ``nccl`` needs CUDA ranks."""
    value = os.environ.get("GUIDESPEC_TP_BACKEND") or None
    if value not in (None, "nccl", "gloo"):
        raise ValueError(f"GUIDESPEC_TP_BACKEND must be nccl or gloo, got {value!r}")
    return value


def worker_threads() -> int | None:
    """``GUIDESPEC_WORKER_THREADS=N``: torch threads per worker rank (default: the cores split
    over the ranks on the CPU, 1 on a GPU). Set it to 1 when several engines share a small machine: oversubscribed
    OpenMP threads spin against each other and every engine slows down many times over."""
    value = os.environ.get("GUIDESPEC_WORKER_THREADS")
    return int(value) if value else None


def tp_shared_memory() -> bool:
    """``GUIDESPEC_TP_SHM=0``: tensor-parallel CPU ranks on one host collect over gloo alone, not
    through shared memory (``ipc/collectives.py``): to measure the difference."""
    return os.environ.get("GUIDESPEC_TP_SHM", "1") != "0"


def step_next() -> bool:
    """``GUIDESPEC_STEP_NEXT=0``: every step's inputs go whole (a StepInputs), never as a
    StepNext after the step before (``protocol.StepNext``): to measure the difference."""
    return os.environ.get("GUIDESPEC_STEP_NEXT", "1") != "0"


def draft_gate() -> str:
    """``GUIDESPEC_DRAFT_GATE``: ``open`` (the default), the draft gate of an n-gram (or user) drafter
    starts open (``scheduler/speculation/gate.py``); ``closed``, it starts closed (its first trial
    is of drafting); ``off``, no gate: the drafter drafts where its drafts do not pay for the whole
    step (for A/B runs)."""
    value = os.environ.get("GUIDESPEC_DRAFT_GATE", "open")
    if value not in ("open", "closed", "off"):
        raise ValueError(f"GUIDESPEC_DRAFT_GATE must be open, closed or off, got {value!r}")
    return value


def draft_spin_us() -> int | None:
    """``GUIDESPEC_DRAFT_SPIN_US=N``: how long each side of the draft channel spins before it
    sleeps on a futex, in microseconds (default: 500 beside a GPU, where a draft step's round trip
    to the scheduler is what a guided step waits on; 0 on the CPU, a few thousand polls)."""
    value = os.environ.get("GUIDESPEC_DRAFT_SPIN_US")
    return max(0, int(value)) if value else None


def ray_placement_timeout_s() -> float:
    """How long to wait for a Ray placement group the cluster could hold but is busy
    (``GUIDESPEC_RAY_PLACEMENT_TIMEOUT_S``)."""
    return float(os.environ.get("GUIDESPEC_RAY_PLACEMENT_TIMEOUT_S", "60"))


def zygote(device: str) -> bool:
    """Whether an engine on ``device`` forks its processes from the client's zygote
    (``launch/zygote.py``; ``GUIDESPEC_ZYGOTE``): ``1`` everywhere, ``0`` nowhere (every engine
    process a new interpreter), unset: CPU engines only (CUDA engines forked from it ran on an H200
    once, equal to new interpreters, since 735deab; their start time there is not measured)."""
    value = os.environ.get("GUIDESPEC_ZYGOTE")
    return value != "0" if value is not None else device == "cpu"


def draft_channel() -> str:
    """How rank 0 exchanges model drafts and their masks with the scheduler
    (``GUIDESPEC_DRAFT_CHANNEL``): ``c`` (default: the cuda_ext shared-memory channel, its C
    functions called directly), ``stream`` (the same functions run by the C host stream, as a
    CUDA stream would call them back) or ``python`` (messages over ZeroMQ and the ring)."""
    value = os.environ.get("GUIDESPEC_DRAFT_CHANNEL", "c")
    return value if value in ("c", "stream", "python") else "c"


def fused_steps() -> bool:
    """Whether an engine whose model drafter's draft steps run as graphs (``graph_grammar``, every rank
    local) also runs each whole greedy speculative step (verify, acceptance, the drafter, the drafts) as
    one graph (``worker/drafting/step_graph.py``; ``GUIDESPEC_FUSED_STEPS``, default ``1``): ``0`` keeps the
    verify step outside (its masks read from the ring in Python), to measure the difference."""
    return os.environ.get("GUIDESPEC_FUSED_STEPS", "1") != "0"


def async_scheduling() -> bool:
    """Whether the scheduler plans and sends each step while the one before runs, where no
    request in it may get drafts (``scheduler.py``; ``GUIDESPEC_ASYNC_SCHEDULING``, default
    ``1``): ``0`` runs the steps one after another, to measure the difference."""
    return os.environ.get("GUIDESPEC_ASYNC_SCHEDULING", "1") != "0"


def overlap_steps(device_type: str) -> bool:
    """Whether a worker launches a greedy decode step before the step before's tokens are on the
    host (``worker.py``: ``_overlapped_step``; ``GUIDESPEC_OVERLAP_STEPS``): by default on CUDA
    only (a CPU step ends when its work does: nothing to overlap); ``0`` never, to measure the
    difference; ``1`` on any device (the CPU too: how the tests without a GPU run it)."""
    value = os.environ.get("GUIDESPEC_OVERLAP_STEPS")
    return value == "1" or (value != "0" and device_type == "cuda")


def draft_mask_timeout_s() -> float:
    """How long rank 0 waits for a draft step's mask before drafting no more this step
    (``GUIDESPEC_DRAFT_MASK_TIMEOUT_S``; a dead scheduler ends the wait at once)."""
    return float(os.environ.get("GUIDESPEC_DRAFT_MASK_TIMEOUT_S", "30"))


def schema_rewrites_enabled() -> bool:
    """``GUIDESPEC_SCHEMA_REWRITES=0`` compiles JSON schemas as sent, without the exact rewrites
    (``grammar_backends/rewrites/``): to measure what the rewrites unlock."""
    return os.environ.get("GUIDESPEC_SCHEMA_REWRITES", "1") != "0"


def crash_loop() -> tuple[int, float]:
    """A restarting LLM gives up after this many engine deaths within this many seconds
    (``GUIDESPEC_CRASH_LOOP_DEATHS``, default 3; ``GUIDESPEC_CRASH_LOOP_WINDOW_S``, default 60)."""
    return (
        int(os.environ.get("GUIDESPEC_CRASH_LOOP_DEATHS", "3")),
        float(os.environ.get("GUIDESPEC_CRASH_LOOP_WINDOW_S", "60")),
    )


def llguidance_lexer_fuel() -> int:
    """llguidance's lexer fuel for one mask (``GUIDESPEC_LLGUIDANCE_LEXER_FUEL``; default 1,000,000,
    llguidance's own 200,000): a grammar whose lexer needs more gives up mid-way, and its request
    fails (``grammar_backends/llguidance_backend.py`` says why this value)."""
    return max(1, int(os.environ.get("GUIDESPEC_LLGUIDANCE_LEXER_FUEL", "1000000")))


def compile_nice() -> int:
    """How much lower than the scheduler's the priority of grammar compiles is
    (``GUIDESPEC_COMPILE_NICE``, a nice increment, default 10; 0 keeps it): the compile process's
    and the scheduler's grammar-loading thread's (``scheduler/grammar/compiling.py``)."""
    return max(0, min(19, int(os.environ.get("GUIDESPEC_COMPILE_NICE", "10"))))


def auto_backends() -> tuple[str, ...] | None:
    """The order backend "auto" tries the grammar backends in (``GUIDESPEC_AUTO_BACKENDS``, e.g.
    ``llguidance,xgrammar``); unset: ``protocol.AUTO_BACKEND_ORDER``."""
    value = os.environ.get("GUIDESPEC_AUTO_BACKENDS")
    return tuple(name.strip() for name in value.split(",") if name.strip()) if value else None
