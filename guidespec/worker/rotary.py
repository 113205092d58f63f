"""Rotary position tables, as transformers computes them, and their application to q and k heads.

A table is cos, sin [max_len, rotary dims] (fp32) of positions 0 .. max_len - 1: transformers'
default inverse frequencies, or its own function for the other RoPE types
(``modeling_rope_utils``), so every RoPE variant it knows is computed as it computes it. Gemma 3
keeps one table per layer type (``rope_parameters`` keyed by "full_attention" and
"sliding_attention"); Phi-3 rotates the first dims of a head only (``partial_rotary_factor``).

Not here: which layer reads which table (``model.py``), the C kernel that rotates and writes the
cache in one pass (``kernels.rope_into_cache``).
"""

from __future__ import annotations

from typing import Any

import torch


from guidespec.worker.kernels import layer_triton

Tables = tuple[torch.Tensor, torch.Tensor]  # cos, sin [max_len, rotary dims]
LAYER_TYPES = ("full_attention", "sliding_attention")


def rope_per_layer_type(hf_config: Any) -> bool:
    """Whether the config keeps RoPE parameters per layer type (Gemma 3)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return any(t in params for t in LAYER_TYPES)


def rotary_tables(hf_config: Any, max_len: int, layer_type: str | None = None) -> Tables:
    """cos, sin [max_len, rotary dims] (fp32), as transformers' rotary module of the family computes
    them (of ``layer_type``'s parameters where they are kept per layer type, full attention's by
    default). Its module itself is used only for dynamic RoPE, which it updates with the sequence
    length: importing a modeling file costs a worker ~2.7 s of its start."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is None and rope_per_layer_type(hf_config):
        layer_type = "full_attention"
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        if layer_type is not None:
            raise ValueError("dynamic RoPE per layer type is not supported")
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        cos, sin = LlamaRotaryEmbedding(config=hf_config)(torch.zeros(1), torch.arange(max_len)[None])
        return cos[0], sin[0]
    if rope_type == "longrope":
        return _longrope_tables(hf_config, max_len, params, layer_type)
    if rope_type == "default":
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        # (Phi-3's default RoPE rotates part of a head; Llama's, Qwen's and Gemma's the whole head)
        partial = params.get("partial_rotary_factor", 1.0) if hf_config.model_type == "phi3" else 1.0
        dim = int(head_dim * partial)
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return _tables(inv_freq, 1.0, max_len)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, layer_type=layer_type)
    return _tables(inv_freq, scaling, max_len)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos, sin [T, R] (R <= D: the first R dims of each head rotate, the
    rest pass; half-rotation layout within them, as transformers' ``rotate_half``)."""
    rotated_dims = cos.shape[-1]
    if x.is_cuda and (fused := layer_triton.rope(x, cos, sin)) is not None:  # one kernel
        return fused
    if rotated_dims < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotated_dims], cos, sin), x[..., rotated_dims:]), dim=-1)
    half = rotated_dims // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _tables(inv_freq: torch.Tensor, scaling: float, max_len: int) -> Tables:
    positions = torch.arange(max_len)[None]
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling)[0], (emb.sin() * scaling)[0]


def _longrope_tables(hf_config: Any, max_len: int, params: dict[str, Any], layer_type: str | None) -> Tables:
    """LongRoPE (Phi-3 128k, Phi-4-mini): the short factors' table below
    ``original_max_position_embeddings``, the long factors' from there on, position by position.
    transformers switches the whole sequence to the long factors once it is longer than that
    (the same tables below it); vLLM keeps both tables in one cache and picks by the batch (any
    position past it: all long). Choosing by position keeps a token's result independent of the
    tokens around it, which speculative greedy needs to equal plain greedy."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    compute = ROPE_INIT_FUNCTIONS["longrope"]
    original = int(params["original_max_position_embeddings"])
    short, scaling = compute(hf_config, layer_type=layer_type)
    long, _ = compute(hf_config, seq_len=original + 1, layer_type=layer_type)
    (cos_short, sin_short), (cos_long, sin_long) = _tables(short, scaling, max_len), _tables(long, scaling, max_len)
    past = (torch.arange(max_len) >= original)[:, None]
    return torch.where(past, cos_long, cos_short), torch.where(past, sin_long, sin_short)
