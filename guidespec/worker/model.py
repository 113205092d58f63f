"""Our decoder, tensor-parallel: Llama's layout (Llama 2/3, SmolLM2, Mistral, Qwen2) and the
families that switch parts of it (``ModelConfig``): Qwen3 (q/k norms), Gemma 3 (norms of 1 + w
around attention and MLP, q/k norms, scaled embeddings, GELU, sliding-window layers with their own
RoPE table), Phi-3 (fused checkpoint projections, partial rotary, LongRoPE).

One forward runs several new positions per request (prefill chunks, decode, and later the
draft positions to verify) over a KV cache indexed by slot. Rotary tables are transformers'
own (``rotary.py``). Weights are stored fused per layer (q|k|v, gate|up): fewer, larger matmuls.
A sliding-window layer attends only its window's keys but its cache keeps every block of the
request (correct, not yet smaller).

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
    PackedWeight,
    QuantizedWeight,
    Weight,
    add_picks_check,
    add_rms_norm,
    available,
    cache_attention,
    embedding,
    linear,
    linear_argmax,
    linear_rows,
    pack,
    quantize,
    rope_into_cache,
    silu_mul,
)
from guidespec.worker.kernels import layer_triton
from guidespec.worker.kernels.attention_triton import paged_attention
from guidespec.worker.kernels.gguf_weights import GGUFWeight, concat_rows
from guidespec.worker.forward_batch import AttentionGroup, ForwardBatch
from guidespec.worker.kv_cache import KVCache
from guidespec.worker.rotary import LAYER_TYPES, Tables, apply_rope, rope_per_layer_type, rotary_tables
from guidespec.worker.tp import TPInfo, all_reduce, gather_vocab

__all__ = ["LlamaModel", "rotary_tables"]


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
        # Gemma: embeddings times sqrt(hidden), the factor rounded to the model's dtype as transformers does
        self.embed_scale = None if cfg.embed_scale is None else torch.tensor(cfg.embed_scale).to(dtype).to(device)
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
        if self.tp.size == 1:  # (its greedy picks read an int8 copy: ``compute_picks``)
            add_picks_check(self.lm_head)
        self.final_norm = self._norm_weight(reader.get("model.norm.weight"))
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
        cut.cos, cut.sin, cut.rotary = self.cos, self.sin, self.rotary[:n]
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
        layer = self._load_norms(reader, p)
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

    def _load_norms(self, reader: ShardReader, p: str) -> dict[str, Any]:
        """A layer's norms: before attention ("input_norm") and before the MLP ("post_norm", HF's
        post_attention_layernorm in Llama's layout, pre_feedforward_layernorm in Gemma 3's); with
        sandwich norms those on the attention's and the MLP's outputs; with q/k norms the per-head
        ones (shared by every head, so whole on every rank), the attention's scale folded into q's."""
        cfg, norm = self.cfg, lambda name, scale=1.0: self._norm_weight(reader.get(p + name), scale)
        layer: dict[str, Any] = {"input_norm": norm("input_layernorm.weight")}
        if cfg.sandwich_norms:
            layer["attn_out_norm"] = norm("post_attention_layernorm.weight")
            layer["post_norm"] = norm("pre_feedforward_layernorm.weight")
            layer["mlp_out_norm"] = norm("post_feedforward_layernorm.weight")
        else:
            layer["post_norm"] = norm("post_attention_layernorm.weight")
        if cfg.qk_norm:
            layer["q_norm"] = norm("self_attn.q_norm.weight", cfg.query_scale)
            layer["k_norm"] = norm("self_attn.k_norm.weight")
        elif cfg.query_scale != 1.0:
            raise ValueError("an attention scale other than head_dim ** -0.5 needs a q norm to fold it into")
        return layer

    def _norm_weight(self, weight: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """An RMSNorm's weight as the model multiplies by it. Gemma's 1 + w is folded here and kept
        in fp32: transformers' Gemma norm scales in fp32 before rounding to the model's dtype (see
        ``_rms_norm``), Llama's rounds first."""
        if not self.cfg.norm_plus_one:
            return self._t(weight * scale if scale != 1.0 else weight)
        return ((1.0 + weight.float()) * scale).to(self.device).contiguous()

    def _linear_parts(self, i: int) -> dict[str, list[TensorPart]]:
        """Layer ``i``'s fused linear weights as the tensors they are made of, cut for this rank:
        column-parallel weights (qkv, gate_up) by rows, row-parallel ones (o, down) by columns.
        A checkpoint that stores them fused (Phi-3's qkv_proj, gate_up_proj) is read as row
        ranges of those tensors, cut the same way."""
        cfg, d = self.cfg, self.cfg.head_dim
        p = f"model.layers.{i}."
        q_rows = (self.kv_heads[0] * cfg.num_query_groups * d, self.kv_heads[1] * cfg.num_query_groups * d)
        kv_rows = (self.kv_heads[0] * d, self.kv_heads[1] * d)
        qkv_names = [p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj")]
        qkv_rows = [q_rows, kv_rows, kv_rows]
        gate_up_names = [p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj")]
        gate_up_rows = [self.intermediate, self.intermediate]
        if cfg.fused_projections:
            qkv_names = [p + "self_attn.qkv_proj.weight"] * 3
            offsets = (0, cfg.num_heads * d, (cfg.num_heads + cfg.num_kv_heads) * d)
            qkv_rows = [_shifted(r, offset) for r, offset in zip(qkv_rows, offsets)]
            gate_up_names = [p + "mlp.gate_up_proj.weight"] * 2
            gate_up_rows = [self.intermediate, _shifted(self.intermediate, cfg.intermediate_size)]
        return {
            "qkv": [(name, rows, None) for name, rows in zip(qkv_names, qkv_rows)],
            "o": [(p + "self_attn.o_proj.weight", None, q_rows)],
            "gate_up": [(name, rows, None) for name, rows in zip(gate_up_names, gate_up_rows)],
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
        """``self.rotary[i]``: layer i's cos, sin [max_len, rotary dims] in the model's dtype (one
        table shared by every layer, or Gemma 3's one per layer type); ``self.cos``, ``self.sin``:
        the full-attention layers' table."""
        n = self.cfg.num_layers
        if rope_per_layer_type(hf_config):
            tables = {t: self._on_device(rotary_tables(hf_config, self.max_model_len, t)) for t in LAYER_TYPES}
            self.rotary = [tables[t] for t in self.cfg.layer_types or ("full_attention",) * n]
            self.cos, self.sin = tables["full_attention"]
        else:
            self.cos, self.sin = self._on_device(rotary_tables(hf_config, self.max_model_len))
            self.rotary = [(self.cos, self.sin)] * n
        rotated = self.cos.shape[-1]
        if rotated != (self.cfg.rotary_dim or self.cfg.head_dim):
            raise ValueError(f"the RoPE tables rotate {rotated} dims of a head, the config says {self.cfg.rotary_dim}")

    def _on_device(self, tables: Tables) -> Tables:
        cos, sin = tables
        return cos.to(self.dtype).to(self.device), sin.to(self.dtype).to(self.device)

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
                # (sorted and distinct: as many as the tokens are all of them, a decode step's)
                return hidden if len(batch.logits_indices) == len(hidden) else hidden[batch.logits_indices]
        delta: torch.Tensor | None = None  # the last block's output, added to x with the next norm
        kept: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x, h = self._add_norm(x, delta, layer["input_norm"])
            if isinstance(capture, tuple) and i in capture:
                kept.extend([x] * capture.count(i))
            attention = self._out_norm(self._attention(h, layer, kv, i, batch), layer.get("attn_out_norm"))
            x, h = self._add_norm(x, attention, layer["post_norm"])
            delta = self._out_norm(self._mlp(h, layer), layer.get("mlp_out_norm"))
        _, x = self._add_norm(x, delta, self.final_norm)
        self.captured = x if capture == "final" else torch.cat(kept, dim=-1) if kept else None
        return x[batch.logits_indices]

    def _forward_in_c(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor | None:
        """Every layer and the final norm in one C call (``kernels/decoder.c``: the loop below, bit
        for bit), [T, hidden]; None where it does not apply: tensor parallelism, rows running
        different token counts, not fp32 CPU weights, a layout it does not compute."""
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
        """The C stack, where it computes this model: Llama's layout (its windows included) with
        one RoPE table, whole heads rotated."""
        ok = (
            self.tp.size == 1
            and self.device == "cpu"
            and self.dtype == torch.float32
            and self.cfg.head_dim % 16 == 0
            and self.cfg.plain_layers
            and all(table is self.rotary[0] for table in self.rotary)
            and self.final_norm.is_contiguous()
            and self.cos.is_contiguous()
            and self.sin.is_contiguous()
        )
        windows = [self.cfg.window(i) for i in range(self.cfg.num_layers)]
        return DecoderStack.of(self.layers, windows) if ok else None

    def _add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its RMS norm times ``weight``); delta None: x and its norm."""
        fused = add_rms_norm(x, delta, weight, self.cfg.rms_norm_eps)
        if fused is None:
            fused = layer_triton.add_rms_norm(x, delta, weight, self.cfg.rms_norm_eps)
        if fused is not None:  # fp32 on the CPU, half precision on CUDA: one call
            return fused
        if delta is not None:
            x = x + delta
        return x, _rms_norm(x, weight, self.cfg.rms_norm_eps)

    def _out_norm(self, out: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """Gemma 3's norm of a block's output before it is added to the residual stream (none in
        the other layouts)."""
        return out if weight is None else _rms_norm(out, weight, self.cfg.rms_norm_eps)

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
        n = tokens_per_row
        # the additive masks, built once a forward where torch's attention needs them
        masks: dict[int | None, torch.Tensor] = {}
        where, tables = kv.locate(token_slots, positions), kv.row_tables(row_slots, key_length)
        x = self._embed(token_ids)
        rotary = {id(table): (table[0][positions], table[1][positions]) for table in self.rotary}
        kept: list[torch.Tensor] = []
        delta: torch.Tensor | None = None  # the last block's output, added to x with the next norm
        for i, layer in enumerate(self.layers):
            x, h = self._add_norm(x, delta, layer["input_norm"])
            if isinstance(capture, tuple) and i in capture:
                kept.extend([x] * capture.count(i))
            cos, sin = rotary[id(self.rotary[i])]
            step = (where, tables, positions)
            attention = self._attention_padded(h, layer, kv, i, step, n, key_length, masks, cos, sin)
            x, h = self._add_norm(x, self._out_norm(attention, layer.get("attn_out_norm")), layer["post_norm"])
            delta = self._out_norm(self._mlp(h, layer), layer.get("mlp_out_norm"))
        _, out = self._add_norm(x, delta, self.final_norm)
        self.captured = out if capture == "final" else torch.cat(kept, dim=-1) if kept else None
        return out

    def _padded_masks(self, positions: torch.Tensor, key_length: int) -> dict[int | None, torch.Tensor]:
        """The attention masks of :meth:`forward_padded` by window (None: causal), each
        [B, 1, G*n, L] with rows ordered (group, token); positions [B, n]. Additive (0 or -inf, in
        the model's dtype), as attention turns a boolean mask into at each call: once a step here."""
        g = self.cfg.num_query_groups
        key_positions = torch.arange(key_length, device=positions.device)[None, None, :]
        causal = key_positions <= positions[:, :, None]  # [B, n, L]

        def additive(allowed: torch.Tensor) -> torch.Tensor:
            blocked = torch.full(allowed.shape, float("-inf"), dtype=self.dtype, device=allowed.device)
            return blocked.masked_fill_(allowed, 0.0)[:, None].repeat(1, 1, g, 1)

        masks: dict[int | None, torch.Tensor] = {None: additive(causal)}
        for window in {w for w in map(self.cfg.window, range(len(self.layers))) if w is not None}:
            masks[window] = additive(causal & (key_positions > positions[:, :, None] - window))
        return masks

    def _attention_padded(
        self,
        h: torch.Tensor,
        layer: dict[str, Any],
        kv: KVCache,
        i: int,
        step: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor],
        n: int,
        key_length: int,
        masks: dict[int | None, torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """``step``: :meth:`KVCache.locate` of the step's tokens, :meth:`KVCache.row_tables` of its
        rows (both once per forward, not per layer: fewer kernels in a captured step) and the
        tokens' positions. In half precision on CUDA: RoPE with the cache write, then attention
        through the block tables, one Triton kernel each; else torch's rotation, writes, gathers
        and SDPA with the additive masks (built at the first layer that needs them)."""
        d, hq, hkv, g = self.cfg.head_dim, self.num_local_heads, self.num_local_kv_heads, self.cfg.num_query_groups
        where, tables, positions = step
        b, window = tables.shape[0], self.cfg.window(i)
        qkv = self._qk_normed(linear(h, layer["qkv"], layer.get("qkv_bias")), layer)
        q = layer_triton.rope_into_cache(qkv, hq, hkv, cos, sin, where, kv.k[i], kv.v[i])
        if q is None:
            qk = apply_rope(qkv[:, : (hq + hkv) * d].view(-1, hq + hkv, d), cos, sin)
            q = qk[:, :hq]
            kv.write_at(i, where, qk[:, hq:], qkv[:, (hq + hkv) * d :].view(-1, hkv, d))
        out = paged_attention(q, kv.k[i], kv.v[i], tables, positions, n, key_length, window)
        if out is None:
            if not masks:
                masks.update(self._padded_masks(positions.view(b, n), key_length))
            keys, values = kv.gather_tables(i, tables, key_length)  # [B, hkv, L, D]: only the rows' slots
            q = q.reshape(b, n, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * n, d)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=masks[window])
            out = out.view(b, hkv, g, n, d).permute(0, 3, 1, 2, 4).reshape(b * n, hq * d)
        return all_reduce(linear(out, layer["o"], layer.get("o_bias")), self.tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[R, hidden] -> fp32 logits [R, vocab] on rank 0, None on the other ranks."""
        local = linear(hidden, self.lm_head).float()
        return gather_vocab(local, self.tp, self.cfg.vocab_size)

    def compute_picks(
        self, hidden: torch.Tensor, mask: tuple[np.ndarray, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Greedy picks of [R, hidden] without the logits: (each row's token as ``argmax_rows``
        picks it from :meth:`compute_logits`' output with ``mask`` read, whether the row is dead),
        or None where the LM head has no such kernel (one rank, packed CPU weights only)."""
        if self.tp.size != 1:
            return None
        return linear_argmax(hidden, self.lm_head, self.cfg.vocab_size, mask)

    @property
    def picks_skip_masked(self) -> bool:
        """Whether :meth:`compute_picks` applies and computes a masked row's LM head only in the
        tiles its mask allows a token in (``packed_linear.c``): one rank, packed CPU weights."""
        return (
            self.tp.size == 1
            and self.device == "cpu"
            and self.dtype == torch.float32
            and isinstance(self.lm_head, PackedWeight | QuantizedWeight)
            and available()
        )

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
            out = embedding(token_ids, self.embed)
        else:
            v0, v1, shard = self.vocab
            inside = (token_ids >= v0) & (token_ids < v1)
            local = torch.where(inside, token_ids - v0, torch.zeros_like(token_ids))
            out = all_reduce(embedding(local, self.embed) * inside[:, None].to(self.dtype), self.tp)
        return out if self.embed_scale is None else out * self.embed_scale

    def _qk_normed(self, qkv: torch.Tensor, layer: dict[str, Any]) -> torch.Tensor:
        """qkv [T, (hq + 2 hkv) * D] with each q and k head RMS-normed (Qwen3, Gemma 3: before
        RoPE), v as it is; qkv itself where the layer has no q/k norms."""
        if "q_norm" not in layer:
            return qkv
        d, hq, hkv, eps = self.cfg.head_dim, self.num_local_heads, self.num_local_kv_heads, self.cfg.rms_norm_eps
        q = _rms_norm(qkv[:, : hq * d].view(-1, hq, d), layer["q_norm"], eps)
        k = _rms_norm(qkv[:, hq * d : (hq + hkv) * d].view(-1, hkv, d), layer["k_norm"], eps)
        return torch.cat([q.flatten(1), k.flatten(1), qkv[:, (hq + hkv) * d :]], dim=-1)

    def _attention(self, h, layer, kv: KVCache, i: int, batch: ForwardBatch) -> torch.Tensor:  # type: ignore[no-untyped-def]
        d, hq, hkv = self.cfg.head_dim, self.num_local_heads, self.num_local_kv_heads
        qkv = self._qk_normed(linear(h, layer["qkv"], layer.get("qkv_bias")), layer)
        cos, sin = self.rotary[i]
        rows = kv.cache_rows(batch.slot_of_token, batch.positions)
        q = None
        if cos.shape[-1] == d:  # the kernel rotates whole heads
            q = rope_into_cache(qkv, hq, hkv, cos, sin, batch.positions, rows, kv.k[i], kv.v[i])
        if q is None:  # torch: rotate, then write the keys and values
            cos, sin = cos[batch.positions], sin[batch.positions]  # [T, R]
            qk = apply_rope(qkv[:, : (hq + hkv) * d].view(-1, hq + hkv, d), cos, sin)  # q and k heads in one go
            q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, (hq + hkv) * d :].view(-1, hkv, d)
            kv.write(i, batch.slot_of_token, batch.positions, k, v)
        window = self.cfg.window(i)
        if len(batch.groups) == 1:
            out = self._attend_group(q, kv, i, batch.groups[0], window)
        else:
            out = torch.empty_like(q)  # [T, hq, D]
            for group in batch.groups:
                out[group.token_index] = self._attend_group(q[group.token_index], kv, i, group, window)
        o = linear(out.reshape(-1, hq * d), layer["o"], layer.get("o_bias"))
        return all_reduce(o, self.tp)

    def _attend_group(
        self, q: torch.Tensor, kv: KVCache, i: int, group: AttentionGroup, window: int | None
    ) -> torch.Tensor:
        """Attention for rows that all run the same number of new tokens ``n``, each query
        attending its last ``window`` keys where the layer has a window.

        Query heads sharing a key/value head are stacked on the query axis, so grouped-query
        attention runs as plain attention without repeating keys:
        q [B*n, hq, D] -> [B, hkv, G*n, D] against k, v [B, hkv, L, D].
        """
        g, d, hkv = self.cfg.num_query_groups, self.cfg.head_dim, self.num_local_kv_heads
        n, b = group.num_new_tokens, len(group.rows)
        tables = kv.block_tables(group.slot_ids)
        out = cache_attention(q, kv.k[i], kv.v[i], tables, group.starts, n, g, window)
        if out is not None:  # on the CPU: the C kernel reads the cache in place
            return out
        k, v = kv.gather(i, group.slots, group.length)
        q = q.view(b, n, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * n, d)
        mask = group.mask_within(window)
        if n * g * group.length <= _SMALL_ATTENTION:
            # decode-sized: three small ops beat the fused kernel's fixed cost on CPU
            scores = torch.matmul(q, k.transpose(-1, -2)) * d**-0.5  # [B, hkv, G*n, L]
            if mask is not None:
                scores = scores.view(b, hkv, g, n, -1).masked_fill(~mask[:, :, None], float("-inf"))
                scores = scores.view(b, hkv, g * n, -1)
            out = torch.matmul(scores.softmax(dim=-1), v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.repeat(1, 1, g, 1))
        return out.view(b, hkv, g, n, d).permute(0, 3, 1, 2, 4).reshape(b * n, hkv * g, d)

    def _mlp(self, h: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        gate_up = linear(h, layer["gate_up"])
        silu = self.cfg.hidden_act == "silu"
        act = silu_mul(gate_up) if silu else None  # fp32 on the CPU: one call
        if act is None and silu:
            act = layer_triton.silu_mul(gate_up)  # half precision on CUDA: one kernel
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = (F.silu(gate) if silu else F.gelu(gate, approximate="tanh")) * up
        return all_reduce(linear(act, layer["down"]), self.tp)


def _shifted(rows: tuple[int, int], offset: int) -> tuple[int, int]:
    return rows[0] + offset, rows[1] + offset


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda and (fused := layer_triton.add_rms_norm(x, None, weight, eps)) is not None:
        return fused[1]
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()  # normalize in fp32
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:  # Gemma's norm (weights kept in fp32): scale in fp32, then round
        return (xf * weight).to(x.dtype)
    return weight * xf.to(x.dtype)  # Llama's: round, then scale in the model dtype
