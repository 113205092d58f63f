"""The engine's config from the user's arguments (``LLM``'s keyword arguments): each checked,
every "auto" decided (the device, the dtype, the context length), the model's files found and
read, and the frozen ``EngineConfig`` built, with the tokenizer that goes with it. Anything the
engine cannot serve (bad arguments, a missing model, an unsupported architecture) raises here,
in the client, before a process starts. It starts no engine; ``LLM`` does."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Sequence

from guidespec import envs, model_files
from guidespec.config import DTYPES, JUMP_FORWARD_MODES, EngineConfig, ModelConfig, SpeculativeConfig
from guidespec.launch import zygote
from guidespec.protocol import BACKEND_CHOICES


def create_engine_config(
    model: str | None,
    *,
    tensor_parallel_size: int,
    dtype: str,
    max_batch_size: int,
    max_model_len: int | None,
    max_num_batched_tokens: int,
    show_progress: bool,
    remote_ranks: Sequence[int],
    grammar_backend: str,
    grammar_compile_timeout_s: float,
    jump_forward: bool | str,
    speculative: SpeculativeConfig | dict[str, Any] | str | None,
    distributed_executor: str,
    ray_address: str | None,
    enable_prefix_caching: bool,
    device: str,
    enforce_eager: bool,
    gpu_memory_utilization: float,
    ray_placement: str,
    graph_grammar: bool | None,
    grammar_fill_threads: int,
    kv_block_size: int = 16,
    kv_cache_tokens: int | None = None,
    grammar_cache_dir: str | os.PathLike[str] | None = None,
    warm_up: bool = True,
) -> tuple[EngineConfig, Any]:
    """The engine's config and the model's tokenizer. Once the device is known it starts this
    client's zygote (``zygote.warm_up``), whose imports then overlap reading the model's files
    (``warm_up=False``: a client that starts no engine itself, e.g. a Ray Serve ingress)."""
    _check_arguments(
        grammar_backend,
        grammar_compile_timeout_s,
        distributed_executor,
        remote_ranks,
        gpu_memory_utilization,
        grammar_fill_threads,
        ray_placement,
    )
    _check_kv_cache(kv_block_size, kv_cache_tokens)
    from guidespec.worker.device import resolve_device, resolve_dtype

    # Ray places its ranks itself: only a local launch needs the GPUs here
    local = 0 if distributed_executor == "ray" else tensor_parallel_size
    resolved_device = resolve_device(device, local, share_gpus=envs.tp_backend() == "gloo")
    if warm_up:
        zygote.warm_up(resolved_device)
    # a GGUF model's own quantized blocks (where the model is a GGUF file's conversion), with fp32
    # arithmetic around them: what "auto" means on the CPU; "float32" dequantizes them
    gguf_blocks = dtype == "gguf" or (dtype == "auto" and resolved_device == "cpu")
    if dtype == "gguf" and resolved_device != "cpu":
        raise ValueError("dtype 'gguf' (the GGUF file's own quantized blocks) runs on CPU workers only")
    config, tokenizer = _model_config(
        model,
        tensor_parallel_size,
        "float32" if gguf_blocks else resolve_dtype(dtype, resolved_device),
        max_batch_size,
        max_model_len,
        max_num_batched_tokens,
        show_progress,
        tuple(remote_ranks),
    )
    spec_config = _speculative_config(speculative)
    return dataclasses.replace(
        config,
        quantized_weights=gguf_blocks,
        grammar_backend=grammar_backend,
        jump_forward=_jump_forward_mode(jump_forward),
        grammar_compile_timeout_s=grammar_compile_timeout_s,
        speculative=spec_config,
        distributed_executor=distributed_executor,
        ray_address=ray_address,
        enable_prefix_caching=enable_prefix_caching,
        device=resolved_device,
        enforce_eager=bool(enforce_eager),
        graph_grammar=None if graph_grammar is None else bool(graph_grammar),
        grammar_fill_threads=grammar_fill_threads,
        gpu_memory_utilization=float(gpu_memory_utilization),
        ray_placement=ray_placement,
        kv_block_size=kv_block_size,
        kv_cache_tokens=_kv_cache_tokens(kv_cache_tokens, config.max_model_len),
        grammar_cache_dir=None if grammar_cache_dir is None else str(Path(grammar_cache_dir).resolve()),
    ), tokenizer


MAX_KV_BLOCK_SIZE = 512


def _check_kv_cache(kv_block_size: int, kv_cache_tokens: int | None) -> None:
    if (
        isinstance(kv_block_size, bool)
        or not isinstance(kv_block_size, int)
        or not 8 <= kv_block_size <= MAX_KV_BLOCK_SIZE
        or kv_block_size % 8
    ):
        raise ValueError(f"kv_block_size must be a multiple of 8 up to {MAX_KV_BLOCK_SIZE}, got {kv_block_size!r}")
    if kv_cache_tokens is not None and (
        isinstance(kv_cache_tokens, bool) or not isinstance(kv_cache_tokens, int) or kv_cache_tokens < 1
    ):
        raise ValueError(f"kv_cache_tokens must be a positive int (None: sized from memory), got {kv_cache_tokens!r}")


def _kv_cache_tokens(kv_cache_tokens: int | None, max_model_len: int) -> int | None:
    if kv_cache_tokens is not None and kv_cache_tokens < max_model_len:
        raise ValueError(
            f"kv_cache_tokens={kv_cache_tokens} holds less than one sequence of max_model_len {max_model_len}"
        )
    return kv_cache_tokens


def _check_arguments(
    grammar_backend: str,
    grammar_compile_timeout_s: float,
    distributed_executor: str,
    remote_ranks: Sequence[int],
    gpu_memory_utilization: float,
    grammar_fill_threads: int,
    ray_placement: str,
) -> None:
    """The arguments checked before any is resolved (the model's own limits come later)."""
    if grammar_backend not in BACKEND_CHOICES:
        raise ValueError(f"grammar_backend must be one of {', '.join(BACKEND_CHOICES)}, got {grammar_backend!r}")
    if grammar_compile_timeout_s <= 0:
        raise ValueError("grammar_compile_timeout_s must be > 0")
    if distributed_executor not in ("mp", "ray"):
        raise ValueError(f"distributed_executor must be 'mp' or 'ray', got {distributed_executor!r}")
    if distributed_executor == "ray" and remote_ranks:
        raise ValueError("remote_ranks and distributed_executor='ray' do not mix: under Ray every rank is remote")
    if not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    if (
        isinstance(grammar_fill_threads, bool)
        or not isinstance(grammar_fill_threads, int)
        or not 1 <= grammar_fill_threads <= 64
    ):
        raise ValueError(f"grammar_fill_threads must be an int in [1, 64], got {grammar_fill_threads!r}")
    if ray_placement not in ("pack", "spread"):
        raise ValueError(f"ray_placement must be 'pack' or 'spread', got {ray_placement!r}")


def _model_config(
    model: str | None,
    tensor_parallel_size: int,
    dtype: str,
    max_batch_size: int,
    max_model_len: int | None,
    max_num_batched_tokens: int,
    show_progress: bool,
    remote_ranks: tuple[int, ...],
) -> tuple[EngineConfig, Any]:
    """The config's model part, checked against the model's own config, and its tokenizer."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if tensor_parallel_size < 1 or max_batch_size < 1 or max_num_batched_tokens < 1:
        raise ValueError("tensor_parallel_size, max_batch_size and max_num_batched_tokens must be >= 1")
    model_dir = model_files.resolve_model_dir(model, show_progress)
    hf_data = model_files.config_data(model_dir)
    hf_config = model_files.load_hf_config(model_dir, hf_data)
    model_cfg = ModelConfig.from_hf(hf_config)
    if any(not 0 < r < tensor_parallel_size for r in remote_ranks):
        raise ValueError(f"remote_ranks must be among ranks 1..{tensor_parallel_size - 1}")
    if model_cfg.num_kv_heads < tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} exceeds the model's {model_cfg.num_kv_heads} key/value heads"
        )
    limit = model_cfg.max_position_embeddings  # (sliding-window layers attend their window past it)
    length = min(limit, 2048) if max_model_len is None else max_model_len
    if not 1 < length <= limit:
        raise ValueError(f"max_model_len must be in (1, {limit}] for this model, got {length}")
    tokenizer = model_files.load_tokenizer(model_dir)
    eos = model_files.eos_token_ids(model_dir, hf_config, tokenizer)
    return EngineConfig(
        model_dir,
        tensor_parallel_size,
        dtype,
        max_batch_size,
        length,
        max(max_num_batched_tokens, max_batch_size),
        eos,
        show_progress,
        remote_ranks,
        model_cfg.vocab_size,
        hf_config=hf_data,
    ), tokenizer


def _jump_forward_mode(value: bool | str) -> str:
    """True: "verified" (the default), False: "off", or a mode's name (config.JUMP_FORWARD_MODES)."""
    if isinstance(value, bool):
        return "verified" if value else "off"
    if value not in JUMP_FORWARD_MODES:
        raise ValueError(f"jump_forward must be True, False or one of {', '.join(JUMP_FORWARD_MODES)}, got {value!r}")
    return value


def _speculative_config(value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """``None`` (off), a method name (``"ngram"``), a dict of SpeculativeConfig fields, or the config."""
    if value is None:
        return None
    if isinstance(value, str):
        value = SpeculativeConfig(method=value)
    elif isinstance(value, dict):
        unknown = set(value) - {f.name for f in dataclasses.fields(SpeculativeConfig)}
        if unknown:
            raise ValueError(f"unknown speculative option(s): {', '.join(sorted(unknown))}")
        value = SpeculativeConfig(**value)
    value.validate()
    if value.method == "user":  # fail here, with the import error, not in the scheduler process
        from guidespec.scheduler.speculation.drafters import UserDrafter

        UserDrafter(value.user_drafter or "")
    draft = value.draft_model
    if value.method == "draft_model" and draft and draft not in ("self", "int8") and not draft.startswith("layers:"):
        value = dataclasses.replace(value, draft_model=str(model_files.resolve_model_dir(draft, show_progress=False)))
    if value.method == "eagle" and draft:
        from guidespec.worker.drafting.eagle_head import check_head_dir

        check_head_dir(Path(draft))  # a missing head fails here, in the client
        value = dataclasses.replace(value, draft_model=str(Path(draft).resolve()))
    return value
