"""GGUF files of each architecture kept in their own blocks (checkpoint.GGUFTensors): every kept
weight equals transformers' conversion of the file (what the converted folder holds), bit for bit.
Tiny random files of each architecture, written with gguf's writer and read by transformers' own
GGUF loader, and the real Gemma 3 270M file where its packages are installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from guidespec.worker import kernels
from guidespec.worker.checkpoint import GGUFTensors, ShardReader, gguf_source
from guidespec.worker.kernels import gguf_weights
from tests.worker.test_quantized import quantized_rows

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the kernel is not built")

# one shape for all: head_dim 128 = hidden / heads (transformers reads no head_dim from Qwen3's file)
SHAPE = dict(hidden=256, intermediate=512, layers=2, heads=2, kv_heads=1, head_dim=128, vocab=320)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {  # GGUF architecture: model type, config's extra fields
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma3": ("gemma3_text", {"sliding_window": 64}),
    "phi3": ("phi3", {"tie_word_embeddings": False}),
}
TYPES = ["Q5_0", "Q5_K", "Q4_K", "Q6_K", "Q8_0", "Q4_0"]  # given to the 2-D tensors in turn


def write_gguf(path: Path, arch: str) -> Any:
    """A random model of GGUF architecture ``arch`` written as a file (2-D tensors in TYPES in turn,
    K-quants only where the inputs come in 256s), and the model transformers converts it into."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = ARCHITECTURES[arch]
    s = SHAPE
    config = AutoConfig.for_model(
        model_type,
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        vocab_size=s["vocab"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    writer = gguf.GGUFWriter(path, arch)
    for add, value in [
        (writer.add_context_length, 128),
        (writer.add_embedding_length, s["hidden"]),
        (writer.add_block_count, s["layers"]),
        (writer.add_feed_forward_length, s["intermediate"]),
        (writer.add_head_count, s["heads"]),
        (writer.add_head_count_kv, s["kv_heads"]),
        (writer.add_key_length, s["head_dim"]),
        (writer.add_value_length, s["head_dim"]),
        (writer.add_rope_dimension_count, s["head_dim"]),
        (writer.add_vocab_size, s["vocab"]),
        (writer.add_pad_token_id, 0),
        (writer.add_bos_token_id, 1),
        (writer.add_eos_token_id, 2),
    ]:
        add(value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        writer.add_sliding_window(64)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], s["layers"])
    rng = np.random.default_rng(0)
    written: set[str] = set()
    for i, (name, shape) in enumerate(shapes.items()):
        base, suffix = name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if gguf_name in written or gguf_name.startswith("None."):  # a tied head; rotary buffers
            continue
        written.add(gguf_name)
        if len(shape) == 1:
            writer.add_tensor(gguf_name, rng.standard_normal(shape).astype(np.float32))
            continue
        type_name = TYPES[i % len(TYPES)]
        if type_name.endswith("_K") and shape[1] % 256:
            type_name = "Q5_0"
        raw = quantized_rows(type_name, shape[0], shape[1], seed=i)
        writer.add_tensor(gguf_name, raw, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_each_architectures_blocks_are_transformers_conversion(tmp_path: Path, arch: str) -> None:
    """Every 2-D weight (a tied head aside: the embedding serves) is kept, in the types of the
    file, and equals what transformers' loader made of it: Llama's q and k rows un-permuted, the
    others' as stored (Gemma 3's loader changes only its 1-D norms)."""
    path = tmp_path / f"{arch}.gguf"
    converted = write_gguf(path, arch)
    blocks = GGUFTensors(path, SHAPE["heads"], SHAPE["kv_heads"])
    tied = converted.config.tie_word_embeddings
    weights = {n: w for n, w in converted.state_dict().items() if w.dim() == 2 and not (tied and n == "lm_head.weight")}
    per_layer = 4 if arch == "phi3" else 7  # (Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj)
    assert len(weights) == 1 + per_layer * SHAPE["layers"] + (0 if tied else 1)
    formats = set()
    for name, expected in weights.items():
        kept = blocks.get(name)
        assert kept is not None and torch.equal(kernels.dense(kept), expected), name
        formats.add(kept.fmt)
    assert {gguf_weights.Q5_1, gguf_weights.Q5F, gguf_weights.Q4F} <= formats


def test_phi3s_fused_weights_are_read_by_their_parts_rows(tmp_path: Path) -> None:
    """Phi-3's file fuses q|k|v (attn_qkv) and gate|up (ffn_up) as the folder's qkv_proj and
    gate_up_proj: a model reads each part (a rank's rows of it) as it reads them from the folder."""
    path = tmp_path / "phi3.gguf"
    state = write_gguf(path, "phi3").state_dict()
    blocks = GGUFTensors(path, SHAPE["heads"], SHAPE["kv_heads"])
    q, kv, inter = SHAPE["heads"] * SHAPE["head_dim"], SHAPE["kv_heads"] * SHAPE["head_dim"], SHAPE["intermediate"]
    for name, rows in [
        ("model.layers.1.self_attn.qkv_proj.weight", [(0, q), (q, q + kv), (q + kv, q + 2 * kv), (64, 128)]),
        ("model.layers.0.mlp.gate_up_proj.weight", [(0, inter), (inter, 2 * inter), (inter + 256, 2 * inter)]),
    ]:
        for r0, r1 in rows:
            part = blocks.get(name, rows=(r0, r1))
            assert part is not None and torch.equal(kernels.dense(part), state[name][r0:r1])
    name, half = "model.layers.0.mlp.gate_up_proj.weight", [(0, 256), (inter, inter + 256)]  # rank 0 of 2
    parts = [blocks.get(name, rows=r) for r in half]
    fused = gguf_weights.concat_rows([w for w in parts if w is not None])
    assert fused is not None and len(parts) == 2
    assert torch.equal(kernels.dense(fused), torch.cat([state[name][r0:r1] for r0, r1 in half]))


def test_other_architectures_keep_nothing(tmp_path: Path) -> None:
    """An architecture whose loader may change its 2-D weights (here Bloom's, whose fused q|k|v
    transformers reorders) is read dequantized, from the folder."""
    path = tmp_path / "bloom.gguf"
    writer = gguf.GGUFWriter(path, "bloom")
    raw = quantized_rows("Q8_0", 96, 32)
    writer.add_tensor("blk.0.attn_qkv.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    blocks = GGUFTensors(path, 1, 1)
    assert blocks.get("transformer.h.0.self_attention.query_key_value.weight") is None
    assert blocks.get("transformer.word_embeddings.weight") is None


def test_gemma_3_270m_blocks_are_the_converted_weights(gemma_model_dir: Path) -> None:
    """Gemma 3 270M's file (Q8_0 embedding and tied head, Q5_0, Q4_K, Q6_K): each 2-D weight kept
    equals the converted folder's, and every linear weight is kept fused as the model fuses it
    (q|k|v in Q5_0 beside a Q8_0 v: as Q8_0)."""
    source = gguf_source(gemma_model_dir)
    assert source is not None
    reader = ShardReader(gemma_model_dir)
    blocks = GGUFTensors(source, 4, 1)
    names = [n for n in reader.names() if n.endswith("proj.weight")]
    assert len(names) == 18 * 7
    for name in names:
        kept = blocks.get(name)
        assert kept is not None and torch.equal(kernels.dense(kept), reader.get(name)), name
    embedding = "model.embed_tokens.weight"
    for rows in [(0, 4096), (100_000, 104_096), (258_048, 262_144)]:
        kept = blocks.get(embedding, rows=rows)
        assert kept is not None and kept.fmt == gguf_weights.Q8_0
        assert torch.equal(kernels.dense(kept), reader.get(embedding, rows=rows))
    for i in range(18):
        p = f"model.layers.{i}."
        for parts in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            kept_parts = [blocks.get(f"{p}{n}.weight") for n in parts]
            assert all(w is not None for w in kept_parts)
            assert gguf_weights.concat_rows([w for w in kept_parts if w is not None]) is not None
