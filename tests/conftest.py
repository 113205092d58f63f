"""Shared fixtures: tiny random Hugging Face models, the real model folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

_TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    # SmolLM2's shape problem in miniature: 3 key/value heads over 2 ranks, tied embeddings
    "llama_odd_heads": dict(
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=None,
    ),
    # the families' switches (tests/worker/test_families.py), windows of a few keys so that prompts
    # run past them: Llama 3's RoPE scaling
    "llama3": dict(
        _TINY,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    # every layer windowed (computed by the whole stack in C too)
    "mistral_window": dict(_TINY, sliding_window=6),
    # q/k norms, head_dim 32 > hidden / heads, its last layer windowed
    "qwen3": dict(
        _TINY, num_hidden_layers=3, head_dim=32, use_sliding_window=True, sliding_window=6, max_window_layers=2
    ),
    # norms of 1 + w around attention and MLP, GELU, a query scale other than head_dim's, two RoPE
    # tables, windowed layers around a full one, tied embeddings
    "gemma3": dict(
        _TINY,
        num_hidden_layers=3,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        tie_word_embeddings=True,
    ),
    # fused qkv and gate_up in the checkpoint, half of each head rotated, LongRoPE switching to its
    # long factors at position 16
    "phi3": dict(
        _TINY,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        original_max_position_embeddings=16,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5, 2.0, 3.0],
            "long_factor": [2.0, 4.0, 8.0, 16.0],
        },
    ),
}
FAMILY_KINDS = ("llama3", "mistral_window", "qwen3", "gemma3", "phi3")


def make_tiny_model(folder: Path, kind: str, vocab_size: int = 300, seed: int = 0) -> Path:
    """A random model of family ``kind`` saved as a Hugging Face folder (safetensors)."""
    from transformers import AutoModelForCausalLM

    config = _tiny_config_class(kind)(vocab_size=vocab_size, rms_norm_eps=1e-5, **TINY_CONFIGS[kind])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random biases, so the Qwen2 bias path is really tested
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
            elif kind in FAMILY_KINDS and name.endswith("norm.weight"):  # (Gemma's start at 0, the others' at 1)
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return folder


def _tiny_config_class(kind: str) -> Any:
    import transformers

    names = {"llama_odd_heads": "LlamaConfig", "llama3": "LlamaConfig", "mistral_window": "MistralConfig"}
    names.update(qwen2="Qwen2Config", qwen3="Qwen3Config", gemma3="Gemma3TextConfig", phi3="Phi3Config")
    return getattr(transformers, names.get(kind, kind.capitalize() + "Config"))


def make_tiny_base_model(folder: Path, kind: str = "llama") -> Path:
    """A tiny random model of family ``kind`` with a tokenizer and no chat template, as a base
    model has: one token per byte (id = the byte's value) and ``<|end|>`` (256), the model's
    vocabulary the same 257 (an engine runs it offline)."""
    from tests.grammar_backends.dataset import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    assert tokenizer.chat_template is None
    make_tiny_model(folder, kind, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_base_model(tmp_path_factory.mktemp("base") / "tiny-base")


@pytest.fixture(scope="session")
def default_llm() -> Any:
    """An engine of the default model with the default settings (``LLM(max_batch_size=8)``),
    shared by the test modules that need no other: an engine start is seconds of CI."""
    from guidespec import LLM

    with LLM(max_batch_size=8, show_progress=False) as engine:
        yield engine


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    from guidespec.model_files import resolve_model_dir

    return resolve_model_dir(None, show_progress=False)


def parent_pid(pid: int) -> int:
    """The parent of process ``pid`` (Linux's /proc)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def leftovers(names: list[str], pids: list[int]) -> tuple[list[str], list[int]]:
    """Of an engine's shared files and processes, those still there (a zombie counts as gone)."""
    files = [n for n in names if os.path.exists(n)]
    alive = [
        p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split(")")[1][:3]
    ]
    return files, alive


@pytest.fixture(scope="session")
def gemma_model_dir() -> Path:
    """Gemma 3 270M converted (``--model gemma-3-270m``): skipped where its packages are not
    installed (``scripts/setup.sh --gemma`` installs them)."""
    from guidespec.model_files import GEMMA_3_270M, ModelNotFoundError, resolve_model_dir

    try:
        return resolve_model_dir(GEMMA_3_270M, show_progress=False)
    except ModelNotFoundError as e:
        pytest.skip(str(e))
