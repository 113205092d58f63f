"""Our Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2 layouts), tensor-parallel.

One forward runs several new positions per request (prefill chunks, decode, and later the
draft positions to verify) over a KV cache indexed by slot. Rotary tables come from
transformers' own rotary module, so every RoPE variant it knows is computed as it computes
it. Weights are stored fused per layer (q|k|v, gate|up): fewer, larger matmuls.

On the CPU, a model converted from a GGUF file can keep the file's own quantized blocks for
its linear weights, embedding and LM head (``quantized=True``: ``kernels/gguf_weights.py``
lists the formats); a weight the kernel cannot take, or a tensor-parallel cut that does not
fall on a block, is dequantized as before.

Not here: sampling (``sampler.py``), the process loop (``worker.py``), file handling
(``checkpoint.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from guidespec.config import ModelConfig
from guidespec.worker.checkpoint import GGUFTensors, ShardReader, gguf_source
from guidespec.worker.kernels import (
    DecoderStack,
    Weight,
    add_rms_norm,
    available,
    cache_attention,
    embedding,
    linear,
    linear_rows,
    pack,
    quantize,
    rope_into_cache,
    silu_mul,
)
from guidespec.worker.kernels.gguf_weights import GGUFWeight, concat_rows
from guidespec.worker.forward_batch import AttentionGroup, ForwardBatch
from guidespec.worker.kv_cache import KVCache
from guidespec.worker.tp import TPInfo, all_reduce, gather_vocab


logger = logging.getLogger(__name__)
LINEAR_WEIGHTS = ("qkv", "o", "gate_up", "down")  # a layer's weights that kernels.pack packs
TensorPart = tuple[str, tuple[int, int] | None, tuple[int, int] | None]  # name, this rank's rows, columns
_SMALL_ATTENTION = 1 << 16  # query rows x keys below which attention is done with plain matmuls


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPInfo,
        dtype: torch.dtype,
        max_model_len: int,
        device: str = "cpu",
        quantized: bool = False,
    ) -> None:
        if cfg.num_kv_heads < tp.size:
            raise ValueError(f"tensor_parallel_size {tp.size} exceeds the model's {cfg.num_kv_heads} key/value heads")
        self.cfg, self.tp, self.dtype, self.device = cfg, tp, dtype, device
        self.quantized = quantized  # keep a GGUF file's own blocks where it can (fp32 on the CPU)
        kv0, kv1 = tp.split(cfg.num_kv_heads)
        self.kv_heads = (kv0, kv1)
        self.num_local_kv_heads = kv1 - kv0
        self.num_local_heads = self.num_local_kv_heads * cfg.num_query_groups
        self.intermediate = tp.split(cfg.intermediate_size)
        self.vocab = tp.vocab_shard(cfg.vocab_size)
        self.max_model_len = max_model_len
        self.layers: list[dict[str, Any]] = []
        self.captured: torch.Tensor | None = None  # forward(capture=...) keeps its features here
        self._stack: DecoderStack | None = None  # the layers for decoder.c, where it applies
        self._stack_checked = False

    # ------------------------------------------------------------------ loading

    def load(self, model_dir: Path, hf_config: object, show_progress: bool = True) -> None:
        # one thread: loading is copies bound by memory, and at an engine's start the other
        # processes (scheduler, grammar compiler, client) are busy importing and loading too; with
        # the cores taken, torch's threads wait on each other (2 threads: 1.7 s here, 1 thread: 0.8 s)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._load(model_dir, hf_config, show_progress)
        finally:
            torch.set_num_threads(threads)

    def _load(self, model_dir: Path, hf_config: object, show_progress: bool) -> None:
        reader = ShardReader(model_dir)
        blocks = self._gguf_blocks(model_dir)
        self.dequantized: list[str] = []  # linear weights not kept as blocks though blocks were asked for
        cfg = self.cfg
        # a tied embedding is loaded once: its rows are looked up and it is the LM head
        self.embed: Weight = self._load_vocab_rows(reader, blocks, "model.embed_tokens.weight")
        if cfg.tie_word_embeddings or not reader.has("lm_head.weight"):
            self.lm_head = self.embed
        else:
            self.lm_head = self._load_vocab_rows(reader, blocks, "lm_head.weight")
        self.final_norm = self._t(reader.get("model.norm.weight"))
        layer_ids = range(cfg.num_layers)
        if show_progress:
            layer_ids = tqdm(layer_ids, desc="guidespec: loading layers", unit="layer", leave=False)
        self.layers = [self._load_layer(reader, blocks, i) for i in layer_ids]
        for weight in [self.embed, self.lm_head, *(w for layer in self.layers for w in layer.values())]:
            if isinstance(weight, GGUFWeight):
                weight.release_blocks()  # cut and fused: only the kernel's layout is read from now on
        if self.dequantized:
            logger.info(
                "rank %d: %d weights run in fp32 (a type the kernel does not take, a cut off 32-input "
                "blocks, or parts in different formats), e.g. %s",
                self.tp.rank,
                len(self.dequantized),
                self.dequantized[0],
            )
        self._init_rotary(hf_config)

    def _gguf_blocks(self, model_dir: Path) -> GGUFTensors | None:
        """The GGUF file's own blocks where this model keeps them: asked to, fp32 on the CPU with
        the kernels built, and a folder converted from a GGUF file."""
        source = gguf_source(model_dir) if self.quantized else None
        if source is None or self.device != "cpu" or self.dtype != torch.float32 or not available():
            return None
        return GGUFTensors(source, self.cfg.num_heads, self.cfg.num_kv_heads)

    def _load_vocab_rows(self, reader: ShardReader, blocks: GGUFTensors | None, name: str) -> Weight:
        """This rank's vocabulary rows of ``name``, zero rows up to the shard size."""
        v0, v1, shard = self.vocab
        kept = None if blocks is None else blocks.get(name, rows=(v0, v1))
        if kept is not None:
            return kept.padded_rows(shard)
        rows = torch.zeros(shard, self.cfg.hidden_size, dtype=self.dtype)
        rows[: v1 - v0] = reader.get(name, rows=(v0, v1))
        return pack(rows.to(self.device))  # packed for the CPU kernel where it applies

    def first_layers(self, n: int) -> LlamaModel:
        """This model cut after its first ``n`` layers, final norm and LM head kept: a draft model
        sharing the target's weights (``worker/drafting/draft_model.py``)."""
        cut = LlamaModel(
            dataclasses.replace(self.cfg, num_layers=n), self.tp, self.dtype, self.max_model_len, self.device
        )
        cut.embed, cut.lm_head, cut.final_norm, cut.layers = self.embed, self.lm_head, self.final_norm, self.layers[:n]
        cut.cos, cut.sin = self.cos, self.sin
        return cut

    def int8_copy(self) -> LlamaModel:
        """This model with its linear layers and LM head rounded to int8 (a scale per output row,
        ``kernels.quantize``), sharing everything else: a draft model that reads a quarter of the
        bytes (``worker/drafting/draft_model.py``)."""
        copy = self.first_layers(self.cfg.num_layers)
        copy.lm_head = quantize(self.lm_head)
        copy.layers = [
            {k: quantize(v) if k in LINEAR_WEIGHTS else v for k, v in layer.items()} for layer in self.layers
        ]
        return copy

    def _load_layer(self, reader: ShardReader, blocks: GGUFTensors | None, i: int) -> dict[str, Any]:
        p = f"model.layers.{i}."
        parts = self._linear_parts(i)
        layer: dict[str, Any] = {
            "input_norm": self._t(reader.get(p + "input_layernorm.weight")),
            "post_norm": self._t(reader.get(p + "post_attention_layernorm.weight")),
        }
        layer.update({key: self._load_linear(reader, blocks, key_parts) for key, key_parts in parts.items()})
        if self.cfg.qkv_bias:
            layer["qkv_bias"] = self._t(
                torch.cat(
                    [reader.get(name.removesuffix("weight") + "bias", rows=rows) for name, rows, _ in parts["qkv"]]
                )
            )
        if self.cfg.o_bias and self.tp.is_driver:  # added once, before the all-reduce sums the ranks
            layer["o_bias"] = self._t(reader.get(p + "self_attn.o_proj.bias"))
        return layer

    def _linear_parts(self, i: int) -> dict[str, list[TensorPart]]:
        """Layer ``i``'s fused linear weights as the tensors they are made of, cut for this rank:
        column-parallel weights (qkv, gate_up) by rows, row-parallel ones (o, down) by columns."""
        cfg, d = self.cfg, self.cfg.head_dim
        p = f"model.layers.{i}."
        q_rows = (self.kv_heads[0] * cfg.num_query_groups * d, self.kv_heads[1] * cfg.num_query_groups * d)
        kv_rows = (self.kv_heads[0] * d, self.kv_heads[1] * d)
        return {
            "qkv": [
                (p + f"self_attn.{n}.weight", r, None)
                for n, r in zip(("q_proj", "k_proj", "v_proj"), (q_rows, kv_rows, kv_rows))
            ],
            "o": [(p + "self_attn.o_proj.weight", None, q_rows)],
            "gate_up": [(p + f"mlp.{n}.weight", self.intermediate, None) for n in ("gate_proj", "up_proj")],
            "down": [(p + "mlp.down_proj.weight", None, self.intermediate)],
        }

    def _load_linear(self, reader: ShardReader, blocks: GGUFTensors | None, parts: list[TensorPart]) -> Weight:
        """One fused weight: the file's blocks where every part has them in one format, else fp32
        (packed for the CPU kernel where it applies)."""
        if blocks is not None:
            kept = [blocks.get(name, rows, cols) for name, rows, cols in parts]
            fused = concat_rows([w for w in kept if w is not None]) if all(w is not None for w in kept) else None
            if fused is not None:
                return fused
            self.dequantized.append(parts[0][0])
        return pack(self._t(torch.cat([reader.get(name, rows, cols) for name, rows, cols in parts])))

    def _init_rotary(self, hf_config: object) -> None:
        self.cos, self.sin = (t.to(self.dtype).to(self.device) for t in rotary_tables(hf_config, self.max_model_len))

    def _t(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype=self.dtype, device=self.device).contiguous()

    def create_kv_cache(self, num_slots: int, block_size: int | None = None, num_blocks: int | None = None) -> KVCache:
        """A cache by slot, or with ``num_blocks`` a pool of blocks whose tables the scheduler sets."""
        return KVCache(
            self.cfg.num_layers,
            num_slots,
            self.num_local_kv_heads,
            self.max_model_len,
            self.cfg.head_dim,
            self.dtype,
            self.device,
            block_size,
            num_blocks,
        )

    # ------------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache, capture: tuple[int, ...] | str | None = None) -> torch.Tensor:
        """Hidden states after the final norm at ``batch.logits_indices``: [R, hidden].

        ``capture`` keeps features of every position in ``self.captured`` for an EAGLE head
        (``worker/drafting/eagle.py``): the inputs of the given layers side by side [T, n * hidden], or
        ``"final"``, the last hidden state after the final norm [T, hidden].
        """
        batch = batch.to(self.device)
        x = self._embed(batch.token_ids)  # [T, H]
        if capture is None:
            hidden = self._forward_in_c(x, batch, kv)
            if hidden is not None:
                self.captured = None
                return hidden[batch.logits_indices]
        delta: torch.Tensor | None = None  # the last block's output, added to x with the next norm
        kept: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x, h = self._add_norm(x, delta, layer["input_norm"])
            if isinstance(capture, tuple) and i in capture:
                kept.extend([x] * capture.count(i))
            x, h = self._add_norm(x, self._attention(h, layer, kv, i, batch), layer["post_norm"])
            delta = self._mlp(h, layer)
        _, x = self._add_norm(x, delta, self.final_norm)
        self.captured = x if capture == "final" else torch.cat(kept, dim=-1) if kept else None
        return x[batch.logits_indices]

    def _forward_in_c(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor | None:
        """Every layer and the final norm in one C call (``kernels/decoder.c``: the loop below, bit
        for bit), [T, hidden]; None where it does not apply: tensor parallelism, rows running
        different token counts, not fp32 CPU weights."""
        if not self._stack_checked:
            self._stack, self._stack_checked = self._build_stack(), True
        n = batch.num_new_tokens[0]
        if self._stack is None or len(batch.groups) != 1 or x.dtype != torch.float32:
            return None
        cfg, group = self.cfg, batch.groups[0]
        return self._stack.run(
            x,
            kv,
            self.final_norm,
            cfg.rms_norm_eps,
            (self.num_local_heads, self.num_local_kv_heads, cfg.head_dim, self.intermediate[1] - self.intermediate[0]),
            (self.cos, self.sin),
            (
                batch.positions,
                kv.cache_rows(batch.slot_of_token, batch.positions),
                kv.block_tables(group.slot_ids),
                group.starts,
            ),
            n,
        )

    def _build_stack(self) -> DecoderStack | None:
        ok = (
            self.tp.size == 1
            and self.device == "cpu"
            and self.dtype == torch.float32
            and self.cfg.head_dim % 16 == 0
            and self.final_norm.is_contiguous()
            and self.cos.is_contiguous()
            and self.sin.is_contiguous()
        )
        return DecoderStack.of(self.layers) if ok else None

    def _add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its RMS norm times ``weight``); delta None: x and its norm."""
        fused = add_rms_norm(x, delta, weight, self.cfg.rms_norm_eps)
        if fused is not None:  # fp32 on the CPU: one call
            return fused
        if delta is not None:
            x = x + delta
        return x, _rms_norm(x, weight, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward_padded(
        self,
        kv: KVCache,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        token_slots: torch.Tensor,
        row_slots: torch.Tensor,
        tokens_per_row: int,
        key_length: int,
        capture: tuple[int, ...] | str | None = None,
    ) -> torch.Tensor:
        """The forward of a fixed shape, for CUDA graphs (``graphs.py``): ``B`` rows of exactly
        ``tokens_per_row`` tokens each, attending the first ``key_length`` keys of their slot.

        token_ids, positions, token_slots [B * n] (token_slots: where each token's keys are
        written; padding goes to a scratch slot); row_slots [B] (whose keys each row reads).
        Returns the normalized hidden states of every position [B * n, hidden]; ``capture`` keeps
        an EAGLE head's features of every position in ``self.captured``, as :meth:`forward`
        does. No host synchronisation and no shape that depends on the values: capturable as it is.
        """
        n, b = tokens_per_row, row_slots.shape[0]
        g = self.cfg.num_query_groups
        key_positions = torch.arange(key_length, device=positions.device)
        allowed = key_positions[None, None, :] <= positions.view(b, n)[:, :, None]  # [B, n, L]
        mask = allowed[:, None].repeat(1, 1, g, 1)  # [B, 1, G*n, L], rows ordered (group, token)
        x = self._embed(token_ids)
        cos, sin = self.cos[positions], self.sin[positions]
        kept: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if isinstance(capture, tuple) and i in capture:
                kept.extend([x] * capture.count(i))
            h = _rms_norm(x, layer["input_norm"], self.cfg.rms_norm_eps)
            x = x + self._attention_padded(
                h, layer, kv, i, positions, token_slots, row_slots, n, key_length, mask, cos, sin
            )
            h = _rms_norm(x, layer["post_norm"], self.cfg.rms_norm_eps)
            x = x + self._mlp(h, layer)
        out = _rms_norm(x, self.final_norm, self.cfg.rms_norm_eps)
        self.captured = out if capture == "final" else torch.cat(kept, dim=-1) if kept else None
        return out

    def _attention_padded(
        self,
        h,
        layer,
        kv: KVCache,
        i: int,
        positions,
        token_slots,
        row_slots,
        n: int,  # type: ignore[no-untyped-def]
        key_length: int,
        mask,
        cos,
        sin,
    ) -> torch.Tensor:
        d, hq, hkv, g = self.cfg.head_dim, self.num_local_heads, self.num_local_kv_heads, self.cfg.num_query_groups
        b = row_slots.shape[0]
        qkv = linear(h, layer["qkv"], layer.get("qkv_bias"))
        qk = _rope(qkv[:, : (hq + hkv) * d].view(-1, hq + hkv, d), cos, sin)
        q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, (hq + hkv) * d :].view(-1, hkv, d)
        kv.write(i, token_slots, positions, k, v)
        keys, values = kv.gather(i, row_slots, key_length)  # [B, hkv, L, D]: only the rows' slots
        q = q.reshape(b, n, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * n, d)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        out = out.view(b, hkv, g, n, d).permute(0, 3, 1, 2, 4).reshape(b * n, hq * d)
        return all_reduce(linear(out, layer["o"], layer.get("o_bias")), self.tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[R, hidden] -> fp32 logits [R, vocab] on rank 0, None on the other ranks."""
        local = linear(hidden, self.lm_head).float()
        return gather_vocab(local, self.tp, self.cfg.vocab_size)

    @property
    def computes_chosen_logits(self) -> bool:
        """Whether :meth:`compute_chosen_logits` applies (one rank, the LM head in GGUF blocks)."""
        return self.tp.size == 1 and isinstance(self.lm_head, GGUFWeight) and available()

    def compute_chosen_logits(self, hidden: torch.Tensor, token_ids: np.ndarray) -> torch.Tensor:
        """[R, hidden] -> fp32 logits [R, len(token_ids)] of those tokens only, each equal to
        :meth:`compute_logits`' (where :attr:`computes_chosen_logits`)."""
        chosen = linear_rows(hidden, self.lm_head, token_ids)
        if chosen is None:
            raise RuntimeError("the LM head cannot compute chosen tokens' logits here")
        return chosen

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return embedding(token_ids, self.embed)
        v0, v1, shard = self.vocab
        inside = (token_ids >= v0) & (token_ids < v1)
        local = torch.where(inside, token_ids - v0, torch.zeros_like(token_ids))
        out = embedding(local, self.embed) * inside[:, None].to(self.dtype)
        return all_reduce(out, self.tp)

    def _attention(self, h, layer, kv: KVCache, i: int, batch: ForwardBatch) -> torch.Tensor:  # type: ignore[no-untyped-def]
        d, hq, hkv = self.cfg.head_dim, self.num_local_heads, self.num_local_kv_heads
        qkv = linear(h, layer["qkv"], layer.get("qkv_bias"))
        rows = kv.cache_rows(batch.slot_of_token, batch.positions)
        q = rope_into_cache(qkv, hq, hkv, self.cos, self.sin, batch.positions, rows, kv.k[i], kv.v[i])
        if q is None:  # torch: rotate, then write the keys and values
            cos, sin = self.cos[batch.positions], self.sin[batch.positions]  # [T, D]
            qk = _rope(qkv[:, : (hq + hkv) * d].view(-1, hq + hkv, d), cos, sin)  # q and k heads in one go
            q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, (hq + hkv) * d :].view(-1, hkv, d)
            kv.write(i, batch.slot_of_token, batch.positions, k, v)
        if len(batch.groups) == 1:
            out = self._attend_group(q, kv, i, batch.groups[0])
        else:
            out = torch.empty_like(q)  # [T, hq, D]
            for group in batch.groups:
                out[group.token_index] = self._attend_group(q[group.token_index], kv, i, group)
        o = linear(out.reshape(-1, hq * d), layer["o"], layer.get("o_bias"))
        return all_reduce(o, self.tp)

    def _attend_group(self, q: torch.Tensor, kv: KVCache, i: int, group: AttentionGroup) -> torch.Tensor:
        """Attention for rows that all run the same number of new tokens ``n``.

        Query heads sharing a key/value head are stacked on the query axis, so grouped-query
        attention runs as plain attention without repeating keys:
        q [B*n, hq, D] -> [B, hkv, G*n, D] against k, v [B, hkv, L, D].
        """
        g, d, hkv = self.cfg.num_query_groups, self.cfg.head_dim, self.num_local_kv_heads
        n, b = group.num_new_tokens, len(group.rows)
        out = cache_attention(q, kv.k[i], kv.v[i], kv.block_tables(group.slot_ids), group.starts, n, g)
        if out is not None:  # on the CPU: the C kernel reads the cache in place
            return out
        k, v = kv.gather(i, group.slots, group.length)
        q = q.view(b, n, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * n, d)
        if n * g * group.length <= _SMALL_ATTENTION:
            # decode-sized: three small ops beat the fused kernel's fixed cost on CPU
            scores = torch.matmul(q, k.transpose(-1, -2)) * d**-0.5  # [B, hkv, G*n, L]
            if group.mask is not None:
                scores = scores.view(b, hkv, g, n, -1).masked_fill(~group.mask[:, :, None], float("-inf"))
                scores = scores.view(b, hkv, g * n, -1)
            out = torch.matmul(scores.softmax(dim=-1), v)
        else:
            mask = None if group.mask is None else group.mask.repeat(1, 1, g, 1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.view(b, hkv, g, n, d).permute(0, 3, 1, 2, 4).reshape(b * n, hkv * g, d)

    def _mlp(self, h: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        gate_up = linear(h, layer["gate_up"])
        act = silu_mul(gate_up)  # fp32 on the CPU: one call
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return all_reduce(linear(act, layer["down"]), self.tp)


def rotary_tables(hf_config: Any, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, head_dim] (fp32) of positions 0 .. max_len - 1, as transformers' Llama
    rotary module computes them: its default inverse frequencies, or its own function for the
    other RoPE types (``modeling_rope_utils``). The module itself is used only for the types it
    updates with the sequence length (dynamic, longrope): importing Llama's modeling file costs
    a worker ~2.7 s of its start."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    positions = torch.arange(max_len)[None]
    if rope_type in ("dynamic", "longrope"):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        cos, sin = LlamaRotaryEmbedding(config=hf_config)(torch.zeros(1, dtype=torch.float32), positions)
        return cos[0], sin[0]
    if rope_type == "default":
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling)[0], (emb.sin() * scaling)[0]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()  # as Hugging Face: normalize in fp32, scale in the model dtype
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos, sin [T, D] (half-rotation layout, as Hugging Face Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]
