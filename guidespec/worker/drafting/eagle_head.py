"""EAGLE-style draft heads: the head itself (:class:`EagleHead`), its checkpoint files and its
memory. :mod:`.eagle` runs it beside the target (``EagleRunner``).

A head is one decoder layer that drafts from the target's own hidden states: at position ``t``
it reads the target's feature ``f_t`` and the embedding of the token that followed, ``x_{t+1}``,
and predicts ``x_{t+2}``; its own output hidden state stands in for the target's feature at the
next draft step. It shares the target's token embedding (and, EAGLE-1, its LM head). Two
checkpoint layouts load:

- **EAGLE-1** (``fc`` over [embedding, feature] with a bias, ``layers.0.*`` without an input
  norm, the target's LM head on the output): the feature is the target's last hidden state
  after its final norm.
- **EAGLE-3** (``fc`` over three target layers' hidden states, ``midlayer.*`` whose attention
  reads [normed embedding, normed hidden] (2 x hidden wide), ``norm``, its own ``lm_head`` over a
  pruned draft vocabulary with ``d2t``: draft id ``i`` is target id ``i + d2t[i]``). The
  features are the inputs of target layers ``aux_layers`` (default 2, L/2, L-3, as EAGLE-3).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from guidespec.config import ModelConfig
from guidespec.worker.checkpoint import ShardReader
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.kernels import Weight, embedding, linear, pack
from guidespec.worker.kv_cache import KVCache
from guidespec.worker.model import LlamaModel, _rms_norm
from guidespec.worker.tp import TPInfo


HEAD_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice: the inputs of layers 2, L/2 and L-3 (low, middle, high features)."""
    return tuple(sorted((min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3))))


def check_head_dir(head_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The head's weight file and its config.json (as a dict); a clear error where either is missing."""
    head_dir = Path(head_dir)
    if not head_dir.is_dir():
        raise FileNotFoundError(f"EAGLE head folder {head_dir} does not exist (train one: guidespec train-eagle)")
    config_path = head_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"EAGLE head folder {head_dir} has no config.json")
    config = json.loads(config_path.read_text())
    for name in HEAD_WEIGHTS:
        if (head_dir / name).exists():
            return head_dir / name, config
    raise FileNotFoundError(f"EAGLE head folder {head_dir} has neither of {', '.join(HEAD_WEIGHTS)}")


def load_head_state(head_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The head's tensors and its config.json (as a dict) from a folder."""
    path, config = check_head_dir(head_dir)
    if path.name.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(path)), config
    return torch.load(path, map_location="cpu", weights_only=True), config  # a local file, tensors only


def save_head(head_dir: Path, state: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    head_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(head_dir / "model.safetensors"))
    (head_dir / "config.json").write_text(json.dumps(config, indent=2))


class EagleHead:
    """The head's weights and one forward step; ``capture`` names the target features it needs."""

    def __init__(
        self,
        head_dir: Path,
        target_cfg: ModelConfig,
        target_hf_config: Any,
        embed: Weight,
        target_lm_head: Weight,
        dtype: torch.dtype,
        max_model_len: int,
        device: str = "cpu",
    ) -> None:
        state, config = load_head_state(head_dir)
        state = {k.removeprefix("model."): v for k, v in state.items()}
        if "midlayer.self_attn.q_proj.weight" in state:
            self.version = 3
            prefix = "midlayer."
        elif "layers.0.self_attn.q_proj.weight" in state:
            self.version = 1
            prefix = "layers.0."
        else:
            raise ValueError(f"{head_dir}: not an EAGLE head (no midlayer.* or layers.0.* attention weights)")
        hidden = target_cfg.hidden_size
        q_in = state[prefix + "self_attn.q_proj.weight"].shape[1]
        expected_in = 2 * hidden if self.version == 3 else hidden
        if q_in != expected_in:
            raise ValueError(
                f"{head_dir}: the head's attention reads {q_in} features, the target's hidden size "
                f"{hidden} needs {expected_in}"
            )
        head_cfg = _head_model_config(config, target_cfg)
        self.cfg = head_cfg
        self.dtype = dtype
        self.eps = head_cfg.rms_norm_eps
        t = lambda x: x.to(dtype=dtype, device=device).contiguous()  # noqa: E731
        self.layer: dict[str, Any] = {
            "qkv": pack(t(torch.cat([state[prefix + f"self_attn.{n}_proj.weight"] for n in "qkv"]))),
            "o": pack(t(state[prefix + "self_attn.o_proj.weight"])),
            "gate_up": pack(
                t(torch.cat([state[prefix + "mlp.gate_proj.weight"], state[prefix + "mlp.up_proj.weight"]]))
            ),
            "down": pack(t(state[prefix + "mlp.down_proj.weight"])),
            "post_norm": t(state[prefix + "post_attention_layernorm.weight"]),
        }
        self.fc = pack(t(state["fc.weight"]))
        self.fc_bias = t(state["fc.bias"]) if "fc.bias" in state else None
        self.embed = embed  # the target's (rank 0 holds it whole when TP = 1; see EagleRunner)
        if self.version == 3:
            self.layer["input_norm"] = t(state[prefix + "input_layernorm.weight"])
            self.layer["hidden_norm"] = t(state[prefix + "hidden_norm.weight"])
            self.norm = t(state["norm.weight"])
            self.lm_head = pack(t(state["lm_head.weight"])) if "lm_head.weight" in state else target_lm_head
            aux = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") or config.get("aux_layers")
            self.aux_layers = tuple(int(i) for i in aux) if aux else default_aux_layers(target_cfg.num_layers)
            if (
                list(self.aux_layers) != sorted(self.aux_layers)
                or not 0 <= min(self.aux_layers) <= max(self.aux_layers) < target_cfg.num_layers
            ):
                raise ValueError(
                    f"{head_dir}: aux layers {self.aux_layers} must ascend within the target's "
                    f"{target_cfg.num_layers} layers"
                )
            if self.fc.shape[1] != len(self.aux_layers) * hidden:
                raise ValueError(
                    f"{head_dir}: fc reads {self.fc.shape[1]} features, {len(self.aux_layers)} target "
                    f"layers of {hidden} give {len(self.aux_layers) * hidden}"
                )
        else:
            self.norm = None
            self.lm_head = target_lm_head
            self.aux_layers = ()
        self.draft_vocab_size = self.lm_head.shape[0]
        self.d2t: torch.Tensor | None = None
        if "d2t" in state and self.draft_vocab_size != target_cfg.vocab_size:
            self.d2t = (torch.arange(self.draft_vocab_size) + state["d2t"].long()).to(device)
        elif self.draft_vocab_size not in (target_cfg.vocab_size, embed.shape[0]):
            raise ValueError(f"{head_dir}: a draft vocabulary of {self.draft_vocab_size} without d2t")
        # attention and rotary: our decoder's own code, on a one-layer model of the head's shape
        self.attn = LlamaModel(head_cfg, TPInfo(), dtype, max_model_len, device)
        self.attn._init_rotary(_rotary_config(target_hf_config, head_cfg))
        # what the draft graphs read (draft_graph.GraphDrafter)
        self.device, self.max_model_len = torch.device(device), max_model_len
        self.feature_width, self.logits_width = head_cfg.hidden_size, self.draft_vocab_size

    forwards_first = False  # draft 0 comes from the follow run's output

    def draft_step(
        self,
        features: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv: KVCache,
        key_length: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step of ``B`` rows: :meth:`forward_padded` of one token each."""
        return self.forward_padded(features, token_ids, positions, slots, kv, key_length)

    @property
    def capture(self) -> tuple[int, ...] | str:
        """What the target forward must keep: layer inputs (EAGLE-3) or its final hidden (EAGLE-1)."""
        return self.aux_layers if self.version == 3 else "final"

    def create_kv_cache(self, num_slots: int, max_model_len: int) -> KVCache:
        c = self.cfg
        return KVCache(1, num_slots, c.num_kv_heads, max_model_len, c.head_dim, self.dtype, self.attn.device)

    @torch.inference_mode()
    def forward(
        self, features: torch.Tensor, token_ids: torch.Tensor, batch: ForwardBatch, kv: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Features [T, F] (target features, or the head's own outputs [T, hidden]) and the tokens
        that followed; returns (output hidden [R, hidden], draft logits [R, draft vocab]) at
        ``batch.logits_indices``."""
        batch = batch.to(self.attn.device)
        h, x = self._inputs(features, token_ids.to(batch.token_ids.device))
        h = h + self.attn._attention(x, self.layer, kv, 0, batch)
        return self._outputs(h[batch.logits_indices])  # (the MLP is per position: picked rows first)

    @torch.inference_mode()
    def forward_padded(
        self,
        features: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv: KVCache,
        key_length: int,
        tokens_per_row: int = 1,
        token_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``B`` rows of ``n`` tokens each, of a fixed shape (``draft_graph.py``, ``step_graph.py``):
        features, token_ids, positions [B * n]; slots [B] (whose keys each row reads);
        token_slots [B * n] (where each token's keys go; default: its row's slot); attends the
        first ``key_length`` keys. Returns (output hidden [B * n, hidden], draft logits
        [B * n, draft vocab]) of every position, capturable as it is."""
        n, b, g = tokens_per_row, slots.shape[0], self.cfg.num_query_groups
        allowed = torch.arange(key_length, device=positions.device)[None, None, :] <= positions.view(b, n)[:, :, None]
        mask = allowed[:, None].repeat(1, 1, g, 1)  # [B, 1, G*n, L], rows ordered (group, token)
        if token_slots is None:
            token_slots = slots if n == 1 else slots.repeat_interleave(n)
        h, x = self._inputs(features, token_ids)
        cos, sin = self.attn.cos[positions], self.attn.sin[positions]
        h = h + self.attn._attention_padded(
            x,
            self.layer,
            kv,
            0,
            (kv.locate(token_slots, positions), kv.row_tables(slots, key_length), positions),
            n,
            key_length,
            {self.attn.cfg.window(0): mask},  # (torch's attention reads it; the paged kernel masks by position)
            cos,
            sin,
        )
        return self._outputs(h)

    def _inputs(self, features: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream, the attention's input) of the head's layer."""
        emb = embedding(token_ids, self.embed)
        if self.version == 3:
            h = linear(features, self.fc) if features.shape[-1] != self.fc.shape[0] else features
            x = torch.cat(
                [_rms_norm(emb, self.layer["input_norm"], self.eps), _rms_norm(h, self.layer["hidden_norm"], self.eps)],
                dim=-1,
            )
            return h, x
        h = linear(torch.cat([emb, features], dim=-1), self.fc, self.fc_bias)
        return h, h

    def _outputs(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP, then (output hidden, draft logits)."""
        h = h + self.attn._mlp(_rms_norm(h, self.layer["post_norm"], self.eps), self.layer)
        normed = _rms_norm(h, self.norm, self.eps) if self.norm is not None else h
        return h, linear(normed, self.lm_head).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else self.d2t[draft_ids]


def head_bytes(
    head_dir: Path, target_cfg: ModelConfig, dtype: torch.dtype, tp_size: int, num_slots: int, max_model_len: int
) -> int:
    """What an EAGLE head adds to rank 0's memory, at most: its weight file, its one layer's
    cache, and at TP > 1 the whole embedding and LM head it reads (rank 0 holds a shard of the
    target's)."""
    path, config = check_head_dir(head_dir)
    cfg = _head_model_config(config, target_cfg)
    item = torch.empty((), dtype=dtype).element_size()
    kv = 2 * num_slots * cfg.num_kv_heads * max_model_len * cfg.head_dim * item
    whole = 0
    if tp_size > 1:
        whole = target_cfg.vocab_size * target_cfg.hidden_size * item * (1 if target_cfg.tie_word_embeddings else 2)
    return path.stat().st_size + kv + whole


def _head_model_config(config: dict[str, Any], target: ModelConfig) -> ModelConfig:
    """The head's attention/MLP shape: its config.json where it says, else the target's; its
    layout Llama's whatever the target's family (EAGLE heads are Llama layers)."""
    heads = int(config.get("num_attention_heads", target.num_heads))
    hidden = int(config.get("hidden_size", target.hidden_size))
    return dataclasses.replace(
        target.llama_layout(),
        num_layers=1,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads", target.num_kv_heads)),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate_size=int(config.get("intermediate_size", target.intermediate_size)),
        rms_norm_eps=float(config.get("rms_norm_eps", target.rms_norm_eps)),
        qkv_bias=False,
        o_bias=False,
    )


def _rotary_config(target_hf_config: Any, head: ModelConfig) -> Any:
    config = copy.deepcopy(target_hf_config)
    config.head_dim = head.head_dim
    config.num_attention_heads = head.num_heads
    config.hidden_size = head.hidden_size
    return config


def whole_embedding(target: LlamaModel, target_dir: Path) -> tuple[Weight, Weight]:
    """Under TP the target's embedding is sharded by vocabulary; the head on rank 0 reads it whole
    from the checkpoint (no collective: the other ranks do not run the head)."""
    reader = ShardReader(target_dir)
    embed = pack(reader.get("model.embed_tokens.weight").to(target.dtype).to(target.device))
    if target.cfg.tie_word_embeddings or not reader.has("lm_head.weight"):
        return embed, embed
    return embed, pack(reader.get("lm_head.weight").to(target.dtype).to(target.device))
