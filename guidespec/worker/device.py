"""Where ranks run and in what precision: the device a rank gets, the dtype a device defaults
to, and whether the model and its KV cache fit the device's memory.

``device="auto"`` is CUDA where torch sees a GPU, else the CPU. A local launch puts rank ``i``
on ``cuda:i`` of the GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible (ranks sharing GPUs over gloo,
``GUIDESPEC_TP_BACKEND=gloo``: ``cuda:(i mod GPUs)``); a Ray rank gets one GPU from
Ray, which sets its ``CUDA_VISIBLE_DEVICES``, so it runs on ``cuda:0``. ``dtype="auto"`` is
bfloat16 on CUDA and float32 on the CPU (whose kernels are fp32).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from guidespec.config import ModelConfig

DEVICES = ("auto", "cuda", "cpu")
# what a forward takes beyond weights and KV (activations, logits, the allocator's slack):
# a floor, plus the fp32 logits of the largest step
_ACTIVATION_FLOOR_BYTES = 512 << 20


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(device: str, num_local_ranks: int, num_gpus: int | None = None, share_gpus: bool = False) -> str:
    """``"cuda"`` or ``"cpu"`` for ``device`` (auto, cuda, cpu); ValueError where CUDA is asked
    for and this machine has fewer GPUs than local ranks (``share_gpus``: than one; the ranks'
    collectives over gloo, ``envs.tp_backend``, let them share). Ranks under Ray are not local:
    Ray places them (``num_local_ranks`` 0)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    gpus = cuda_device_count() if num_gpus is None else num_gpus
    if device == "auto":
        device = "cuda" if gpus > 0 else "cpu"
    if device == "cuda" and gpus < (min(num_local_ranks, 1) if share_gpus else num_local_ranks):
        seen = "no GPU" if gpus == 0 else f"{gpus} GPU{'s' if gpus > 1 else ''}"
        raise ValueError(
            f"device 'cuda' with {num_local_ranks} local rank{'s' if num_local_ranks > 1 else ''} needs "
            f"{'a GPU' if share_gpus else 'as many GPUs'}; torch sees {seen} (check CUDA_VISIBLE_DEVICES and "
            "the driver, lower --tensor-parallel-size, or use --device cpu)"
        )
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype's name; ``auto``: bfloat16 on CUDA, float32 on the CPU."""
    if dtype == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return dtype


def rank_device(device: str, local_index: int | None, num_gpus: int | None = None) -> str:
    """The torch device of a rank: ``cuda:<its index among the local ranks>``, modulo the GPUs
    where the ranks outnumber them (ranks sharing GPUs over gloo: ``envs.tp_backend``); a Ray
    rank, whose index is None, has its one GPU as ``cuda:0``; or ``cpu``."""
    if device == "cpu":
        return "cpu"
    if local_index is None:
        return "cuda:0"
    gpus = cuda_device_count() if num_gpus is None else num_gpus
    return f"cuda:{local_index % gpus if gpus else local_index}"


@dataclass(frozen=True)
class MemoryPlan:
    """What one rank holds, in bytes."""

    weights: int
    kv_cache: int
    activations: int
    drafter: int = 0  # rank 0's model drafter (draft model or EAGLE head): its weights and cache

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.drafter


def memory_plan(
    cfg: ModelConfig, dtype: torch.dtype, tp_size: int, num_slots: int, max_model_len: int, max_step_rows: int
) -> MemoryPlan:
    """The bytes of rank 0's shard (the largest: it owns the first extra heads of an uneven cut)."""
    item = torch.empty((), dtype=dtype).element_size()
    kv_heads = -(-cfg.num_kv_heads // tp_size)
    q_heads = kv_heads * cfg.num_query_groups
    inter = -(-cfg.intermediate_size // tp_size)
    vocab = -(-cfg.vocab_size // tp_size)
    d, h = cfg.head_dim, cfg.hidden_size
    per_layer = (q_heads + 2 * kv_heads) * d * h + q_heads * d * h + 3 * inter * h + 2 * h
    embeddings = vocab * h * (1 if cfg.tie_word_embeddings else 2)
    weights = (cfg.num_layers * per_layer + embeddings + h) * item
    kv = 2 * cfg.num_layers * num_slots * kv_heads * max_model_len * d * item
    activations = _ACTIVATION_FLOOR_BYTES + max_step_rows * cfg.vocab_size * 4 * 2
    return MemoryPlan(weights, kv, activations)


def check_fits(
    plan: MemoryPlan,
    free_bytes: int,
    total_bytes: int,
    utilization: float,
    num_slots: int,
    max_model_len: int,
    device_name: str,
) -> None:
    """ValueError, with the numbers and what to change, where the plan does not fit
    ``utilization`` of the device's memory (and what other processes already took)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = min(int(total_bytes * utilization), free_bytes)
    if plan.total <= budget:
        return
    gib = 1 << 30
    room_for_kv = budget - plan.weights - plan.activations - plan.drafter
    drafter = f" (the drafter: {plan.drafter / gib:.2f} GiB more)" if plan.drafter else ""
    if room_for_kv <= 0:
        raise ValueError(
            f"the model does not fit {device_name}: its weights take {plan.weights / gib:.2f} GiB{drafter} and a "
            f"step ~{plan.activations / gib:.2f} GiB, of {budget / gib:.2f} GiB usable "
            f"({utilization:.0%} of {total_bytes / gib:.1f} GiB, {free_bytes / gib:.1f} GiB free); use more "
            "tensor-parallel ranks, a smaller dtype, or a larger GPU"
        )
    per_slot = plan.kv_cache // max(1, num_slots)
    fitting = room_for_kv // max(1, per_slot)
    raise ValueError(
        f"the KV cache does not fit {device_name}: {num_slots} slots x {max_model_len} positions take "
        f"{plan.kv_cache / gib:.2f} GiB beside {plan.weights / gib:.2f} GiB of weights{drafter}, of "
        f"{budget / gib:.2f} GiB usable ({utilization:.0%} of {total_bytes / gib:.1f} GiB); "
        f"--max-batch-size {max(1, fitting - 1)} fits at this --max-model-len (or lower --max-model-len, "
        "or raise --gpu-memory-utilization)"
    )


def check_device_memory(
    cfg: ModelConfig,
    dtype: torch.dtype,
    tp_size: int,
    num_slots: int,
    max_model_len: int,
    max_step_rows: int,
    device: str,
    utilization: float,
    drafter_bytes: int = 0,
) -> MemoryPlan:
    """On CUDA, :func:`check_fits` against the device's free memory before anything is loaded
    (``drafter_bytes``: what rank 0's model drafter adds)."""
    plan = dataclasses.replace(
        memory_plan(cfg, dtype, tp_size, num_slots, max_model_len, max_step_rows), drafter=drafter_bytes
    )
    if torch.device(device).type == "cuda":
        free, total = torch.cuda.mem_get_info(torch.device(device))
        check_fits(plan, free, total, utilization, num_slots, max_model_len, torch.cuda.get_device_name(device))
    return plan


# the share of the memory the CPU has available at start that the KV pool may take by default
CPU_KV_SHARE = 0.4


def kv_pool_blocks(
    plan: MemoryPlan,
    bytes_per_token: int,
    block_size: int,
    max_model_len: int,
    num_slots: int,
    device: str,
    utilization: float,
    kv_cache_tokens: int | None = None,
    tp_size: int = 1,
) -> int:
    """The blocks of a rank's KV pool (``bytes_per_token``: a token's keys and values on this
    rank). ``kv_cache_tokens`` where given; else on CUDA what ``utilization`` of the device leaves
    beside what is in use (the weights, loaded by now) and ``plan``'s step and drafter, and on the
    CPU ``CPU_KV_SHARE`` of the memory available at start (the ranks of one machine share it); never
    more than every slot at
    ``max_model_len`` needs. ValueError where not even one sequence of ``max_model_len`` fits."""
    per_sequence = -(-max_model_len // block_size)
    if kv_cache_tokens is not None:
        blocks = -(-kv_cache_tokens // block_size)
        source = f"kv_cache_tokens={kv_cache_tokens}"
    else:
        if torch.device(device).type == "cuda":
            # (measured once the weights are loaded: what is in use counts them, and other processes)
            free, total = torch.cuda.mem_get_info(torch.device(device))
            room = int(total * utilization) - (total - free) - plan.activations - plan.drafter
            source = f"{utilization:.0%} of the GPU's memory beside the weights"
        else:
            room = int(_cpu_available_bytes() * CPU_KV_SHARE) // max(1, tp_size)
            source = f"{CPU_KV_SHARE:.0%} of the memory available at start"
        blocks = min(num_slots * per_sequence, max(0, room) // max(1, bytes_per_token * block_size))
    if blocks < per_sequence:
        raise ValueError(
            f"the KV cache holds {blocks * block_size} tokens ({source}), fewer than one sequence of "
            f"--max-model-len {max_model_len}: lower --max-model-len, or give the cache more "
            "(--kv-cache-tokens, --gpu-memory-utilization)"
        )
    return blocks


def _cpu_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
