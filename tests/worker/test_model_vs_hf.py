"""Our model's logits equal Hugging Face transformers' within 1e-4 (fp32), TP=1 and TP=2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from guidespec.config import ModelConfig
from guidespec.model_files import load_hf_config
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.model import LlamaModel
from guidespec.worker.tp import TPInfo, destroy_distributed, init_distributed
from tests.conftest import make_tiny_model

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], [201, 7, 7, 9, 100]]


def hf_logits(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


def our_logits(model_dir: Path, prompts: list[list[int]], tp: TPInfo = TPInfo()) -> list[torch.Tensor] | None:
    """Every position's logits, computed in two steps per prompt (a prefill chunk, then the rest
    with the other prompts batched) so chunking and mixed batches are exercised too."""
    hf = load_hf_config(model_dir)
    model = LlamaModel(ModelConfig.from_hf(hf), tp, torch.float32, max_model_len=64)
    model.load(model_dir, hf, show_progress=False)
    kv = model.create_kv_cache(len(prompts))
    split = [len(p) // 2 for p in prompts]
    first = ForwardBatch.create(
        [t for p, s in zip(prompts, split) for t in p[:s]], list(range(len(prompts))), [0] * len(prompts), split, split
    )
    second = ForwardBatch.create(
        [t for p, s in zip(prompts, split) for t in p[s:]],
        list(range(len(prompts))),
        split,
        [len(p) - s for p, s in zip(prompts, split)],
        [len(p) - s for p, s in zip(prompts, split)],
    )
    a = model.compute_logits(model.forward(first, kv))
    b = model.compute_logits(model.forward(second, kv))
    if a is None or b is None:
        return None
    out, ia, ib = [], 0, 0
    for p, s in zip(prompts, split):
        out.append(torch.cat([a[ia : ia + s], b[ib : ib + len(p) - s]]))
        ia, ib = ia + s, ib + len(p) - s
    return out


@pytest.mark.parametrize("kind", ["llama", "llama_odd_heads", "qwen2", "mistral"])
def test_tp1_logits_match_hf(tmp_path: Path, kind: str) -> None:
    folder = make_tiny_model(tmp_path / kind, kind)
    for ours, ref in zip(our_logits(folder, PROMPTS), hf_logits(folder, PROMPTS)):  # type: ignore[arg-type]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def _tp_rank(rank: int, folder: Path, init: str, out: Path, prompts: list[list[int]] = PROMPTS) -> None:
    init_distributed(TPInfo(rank, 2), init)
    try:
        logits = our_logits(folder, prompts, TPInfo(rank, 2))
        if rank == 0:
            torch.save(logits, out)
        else:
            assert logits is None
    finally:
        destroy_distributed()


@pytest.mark.parametrize("kind", ["llama_odd_heads", "qwen2"])
def test_tp2_logits_match_hf(tmp_path: Path, kind: str) -> None:
    from guidespec.launch.launcher import _free_port

    folder = make_tiny_model(tmp_path / kind, kind)
    out = tmp_path / "logits.pt"
    mp.start_processes(_tp_rank, args=(folder, f"tcp://127.0.0.1:{_free_port()}", out), nprocs=2, start_method="spawn")
    for ours, ref in zip(torch.load(out), hf_logits(folder, PROMPTS)):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_real_model_logits_match_hf(real_model_dir: Path) -> None:
    prompts = [[1, 4093, 28, 2683, 314, 253, 1345, 30], [504, 3458, 282, 4649, 314]]
    for ours, ref in zip(our_logits(real_model_dir, prompts), hf_logits(real_model_dir, prompts)):  # type: ignore[arg-type]
        # Logits here reach ~20 after 30 layers; two fp32 summation orders (our packed kernel,
        # the BLAS) drift apart by up to ~1e-4 absolute there, so allow 1e-5 relative on top.
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    ],
)
def test_rotary_tables_equal_transformers_rotary_module(rope: dict[str, object]) -> None:
    """Our tables (computed without importing Llama's modeling file, for a fast worker start)
    are transformers' own, bit for bit, for each RoPE type."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from guidespec.worker.model import rotary_tables

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=4096, rope_parameters=rope)
    cos, sin = LlamaRotaryEmbedding(config=config)(torch.zeros(1), torch.arange(4096)[None])
    ours = rotary_tables(config, 4096)
    assert torch.equal(ours[0], cos[0]) and torch.equal(ours[1], sin[0])


@pytest.mark.parametrize("kind", ["real", "llama", "qwen2", "mistral", "yarn", "qwen3", "gemma3", "phi3"])
def test_engine_processes_read_the_config_transformers_reads(
    tmp_path: Path, kind: str, real_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine processes read the model's config as plain data, cached by content, not through
    transformers' config classes (a fast start): the model shape, the rotary tables and the end
    ids are those of the config class; a RoPE kind that needs the class gets the class."""
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig

    from guidespec.model_files import config_data, eos_token_ids
    from guidespec.worker.rotary import LAYER_TYPES, rope_per_layer_type, rotary_tables

    monkeypatch.setenv("GUIDESPEC_CACHE_DIR", str(tmp_path / "cache"))
    if kind == "real":
        folder = real_model_dir
    elif kind == "yarn":
        folder = tmp_path / "yarn"
        LlamaConfig(
            hidden_size=64,
            num_attention_heads=4,
            max_position_embeddings=512,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ).save_pretrained(folder)
    else:
        folder = make_tiny_model(tmp_path / kind, kind)
    reference = AutoConfig.from_pretrained(folder)
    first, again = load_hf_config(folder), load_hf_config(folder, config_data(folder))
    assert len(list((tmp_path / "cache" / "configs").glob("*.json"))) == 1  # read once, then from the cache
    layer_types = LAYER_TYPES if rope_per_layer_type(reference) else (None,)  # Gemma 3: a table per type
    for ours in (first, again):
        assert (type(ours) is type(reference)) == (kind in ("yarn", "phi3"))  # (phi3: LongRoPE)
        assert ModelConfig.from_hf(ours) == ModelConfig.from_hf(reference)
        for layer_type in layer_types:
            for a, b in zip(rotary_tables(ours, 512, layer_type), rotary_tables(reference, 512, layer_type)):
                assert torch.equal(a, b)
    if kind == "real":
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert eos_token_ids(folder, first, tokenizer) == eos_token_ids(folder, reference, tokenizer) == (2,)


def test_engine_processes_load_the_tokenizer_transformers_loads(real_model_dir: Path) -> None:
    """The real model's tokenizer, loaded without AutoTokenizer's detour through the config
    class, is AutoTokenizer's: same class, settings, chat prompt and ids."""
    from transformers import AutoTokenizer

    from guidespec.model_files import load_tokenizer

    ours, reference = load_tokenizer(real_model_dir), AutoTokenizer.from_pretrained(real_model_dir)
    assert type(ours) is type(reference) and ours.init_kwargs == reference.init_kwargs
    chat = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": 'Say {"a": [1, 2]} ünïcode'}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == reference.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (
        reference.eos_token_id,
        reference.bos_token_id,
        len(reference),
    )
