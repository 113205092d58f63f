"""EAGLE-style draft heads (one-model speculation), run by rank 0 of the workers.

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

How it follows the target (``EagleRunner``): after each step's verification, every position
whose feature is final (the row's non-draft tokens and its accepted drafts) goes through the
head with the token that followed it; the head's KV cache (same slots as the target's) is
overwritten from there on, so rejected draft positions need no rewind. A non-final prefill
chunk's last position waits for the next chunk's first token (``pending``). A row that is not
asked for drafts this step keeps its positions in a ``backlog`` instead, run in one batch the
next time it is (lazy following: the adaptive plan can turn the head off at no cost). The last
position's output gives the first draft; each further draft step feeds the head its own output and the
drafted token. Draft steps of guided rows are masked by the scheduler's grammar as the draft
model's are (``draft_model.py``); with a pruned vocabulary the target mask is read through ``d2t``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from guidespec.config import ModelConfig
from guidespec.cuda_ext.channel import DraftChannel
from guidespec.protocol import StepInputs
from guidespec.worker.drafting.draft_graph import DraftGraphs
from guidespec.worker.drafting.draft_model import DraftSampling, MaskSource, apply_masks, flat_drafts, post_masks
from guidespec.worker.graphs import GraphKey, StaticBuffers
from guidespec.worker.kernels import Weight, embedding, linear, pack
from guidespec.worker.kv_cache import KVCache
from guidespec.worker.model import ForwardBatch, LlamaModel, _rms_norm
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
            positions,
            token_slots,
            slots,
            n,
            key_length,
            mask,
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


class EagleRunner:
    """Follows the target with an EAGLE head and proposes each row's next drafts (rank 0)."""

    def __init__(
        self,
        head_dir: Path,
        target: LlamaModel,
        target_dir: Path,
        target_hf_config: Any,
        max_batch_size: int,
        max_model_len: int,
    ) -> None:
        if target.tp.size != 1:
            embed, lm_head = _whole_embedding(target, target_dir)
        else:
            embed, lm_head = target.embed, target.lm_head
        self.device = torch.device(target.device)
        self.head = EagleHead(
            head_dir, target.cfg, target_hf_config, embed, lm_head, target.dtype, max_model_len, target.device
        )
        self.max_batch_size, self.max_model_len = max_batch_size, max_model_len
        self.vocab_size = target.cfg.vocab_size
        # one slot more than the batch: fixed-shape draft steps (draft_graph.py) pad onto it
        self.kv = self.head.create_kv_cache(max_batch_size + 1, max_model_len)
        width = len(self.head.aux_layers) * target.cfg.hidden_size if self.head.version == 3 else target.cfg.hidden_size
        self.pending = torch.zeros(max_batch_size, width, dtype=target.dtype, device=self.device)
        self.pending_pos = np.full(max_batch_size, -2, dtype=np.int64)
        self.backlog: dict[int, tuple[int, list[torch.Tensor], list[int]]] = {}  # slot -> positions not yet run
        self._step: tuple[ForwardBatch, torch.Tensor] | None = None  # the step and its target features, until propose
        self.sampling = DraftSampling(self.vocab_size)
        # where each draft id's bit sits in a target bitmask row (rows of a padded LM head past the
        # vocabulary are never allowed)
        ids = self.head.d2t.cpu() if self.head.d2t is not None else torch.arange(self.head.draft_vocab_size)
        self._mask_inside = ids < self.vocab_size
        ids = ids.clamp(max=self.vocab_size - 1)
        self._mask_word, self._mask_bit = ids >> 5, ids & 31
        self.graphs: DraftGraphs | None = None  # fixed-shape draft steps, set by use_graphs

    def use_graphs(self, channel: DraftChannel, timeout_s: float, peer_pid: int, capture: bool) -> None:
        """Run greedy draft steps as fixed-shape graphs whose grammar waits are the draft channel's
        C trampolines in stream order (captured CUDA graphs, or on the CPU the same steps eagerly)."""
        self.graphs = DraftGraphs(
            self.head,
            self.kv,
            self.max_batch_size,
            channel,
            timeout_s,
            peer_pid,
            capture,
            (self._mask_word, self._mask_bit, self._mask_inside),
        )

    @property
    def capture(self) -> tuple[int, ...] | str:
        return self.head.capture

    def follow(self, batch: ForwardBatch, features: torch.Tensor | None) -> None:
        """Keep the step's target features until its tokens are verified (``propose``). A previous
        step that had no logits (prefill chunks only: the worker proposes nothing after it) puts
        its positions in the backlog first."""
        assert features is not None, "the target forward did not keep the features the EAGLE head needs"
        self._hold_step()
        self._step = batch, features

    def _hold_step(self) -> None:
        """The kept step had no logits (prefill chunks only: nothing proposed after it): its final
        positions go to the backlog."""
        if self._step is None:
            return
        (last, last_features), self._step = self._step, None
        offsets = np.concatenate([[0], np.cumsum(last.num_new_tokens)])
        ids = last.token_ids.tolist()
        for b, (slot, start) in enumerate(zip(last.slots, last.start_positions)):
            chunk = self._final_positions(
                slot, start, ids[offsets[b] : offsets[b + 1]], last_features[offsets[b] : offsets[b + 1]], 0
            )
            if chunk is not None:
                self._hold(slot, *chunk)

    @torch.inference_mode()
    def catch_up(self, inputs: StepInputs) -> int:
        """Before a fused step (``step_graph.py``, which follows only the step's own positions):
        run the positions of the step's rows the head has not followed yet (an earlier step's
        without logits, a row the adaptive plan held back, a prefill chunk's last position waiting
        for this step's first token), as ``propose`` runs them. The number of positions run."""
        self._hold_step()
        offsets = np.concatenate([[0], np.cumsum(inputs.num_new_tokens)])
        feats, ids, slots, starts, lens = [], [], [], [], []
        for b, (slot, start) in enumerate(zip(inputs.slots.tolist(), inputs.start_positions.tolist())):
            if self.pending_pos[slot] == start - 1:
                self._hold(slot, start - 1, self.pending[slot][None], [int(inputs.token_ids[offsets[b]])])
                self.pending_pos[slot] = -2
            held = self.backlog.pop(slot, None)
            if held is None or held[0] + len(held[2]) != start:  # (a gap: dropped, as propose does)
                continue
            feats.append(torch.cat(held[1]))
            ids.extend(held[2])
            slots.append(slot)
            starts.append(held[0])
            lens.append(len(held[2]))
        if slots:
            batch = ForwardBatch.create(np.array(ids), slots, starts, lens, np.ones(len(slots), dtype=np.int32))
            self.head.forward(torch.cat(feats), batch.token_ids, batch, self.kv)
        return len(ids)

    def follow_padded(
        self, features: torch.Tensor | None, picks: torch.Tensor, buffers: StaticBuffers, key: GraphKey
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A fused step's follow (``step_graph.py``): the head over every position of the step laid
        out padded, the target's picks as the tokens that follow (rejected positions write past
        the row's end). Its (output, draft logits) of every position."""
        assert features is not None, "the target forward did not keep the features the EAGLE head needs"
        return self.head.forward_padded(
            features,
            picks,
            buffers.positions,
            buffers.row_slots,
            self.kv,
            key.key_length,
            key.tokens_per_row,
            buffers.token_slots,
        )

    def _final_positions(
        self, slot: int, start: int, true: list[int], features: torch.Tensor, produced: int
    ) -> tuple[int, torch.Tensor, list[int]] | None:
        """A row's positions whose features are final, each with the token that followed it:
        (first position, features, tokens), or None. ``true``: the row's final tokens from ``start``
        (its non-draft tokens, then the ``produced`` tokens it sampled or accepted); ``features``:
        the target's, from ``start``. A position whose next token is not known yet (a prefill
        chunk's last) waits in ``pending`` for the next chunk."""
        row_feats, row_ids, first = features[: len(true) - 1], true[1:], start
        if start == 0:
            self.pending_pos[slot] = -2
            self.backlog.pop(slot, None)
        elif self.pending_pos[slot] == start - 1:  # the last chunk's final position, waiting for this token
            row_feats = torch.cat([self.pending[slot][None], row_feats])
            row_ids.insert(0, true[0])
            first = start - 1
        if produced == 0:  # its next token is not known yet
            m = len(true)
            self.pending[slot] = features[m - 1]
            self.pending_pos[slot] = start + m - 1
        return (first, row_feats, row_ids) if row_ids else None

    def _hold(self, slot: int, first: int, features: torch.Tensor, ids: list[int]) -> None:
        """Keep positions for the next time the row proposes (lazy following)."""
        held = self.backlog.get(slot)
        if held is None:
            self.backlog[slot] = (first, [features.clone()], list(ids))
        else:
            held[1].append(features.clone())
            held[2].extend(ids)

    @torch.inference_mode()
    def propose(
        self, inputs: StepInputs, tokens: np.ndarray, counts: np.ndarray, masks: MaskSource | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Run the step's final positions through the head, then chain ``draft_lens[b]`` drafts per
        row (argmax, or drawn from q' for sampled rows): (flat draft tokens as target ids, counts)."""
        assert self._step is not None, "propose without follow"
        features, self._step = self._step[1], None
        ends = np.cumsum(counts)
        offsets = np.concatenate([[0], np.cumsum(inputs.num_new_tokens)])
        last_position = np.full(inputs.batch_size, -1, dtype=np.int64)
        chunks: dict[int, tuple[int, torch.Tensor, list[int]]] = {}  # batch row -> (first position, features, tokens)
        for b in range(inputs.batch_size):
            n, c = int(inputs.num_new_tokens[b]), int(counts[b])
            m = n - max(int(inputs.num_logits[b]), 1) + 1  # the row's non-draft tokens
            true = inputs.token_ids[offsets[b] : offsets[b] + m].tolist() + tokens[ends[b] - c : ends[b]].tolist()
            chunk = self._final_positions(
                int(inputs.slots[b]), int(inputs.start_positions[b]), true, features[offsets[b] : offsets[b] + n], c
            )
            if chunk is not None:
                chunks[b] = chunk
                last_position[b] = chunk[0] + len(chunk[2]) - 1
        wanted = np.zeros(inputs.batch_size, dtype=np.int64)
        if inputs.draft_lens is not None:
            wanted = np.minimum(inputs.draft_lens, self.max_model_len - 2 - last_position)
            wanted[(counts == 0) | (last_position < 0)] = 0
        drafts: list[list[int]] = [[] for _ in range(inputs.batch_size)]
        self.sampling.start()
        # rows that propose now run their backlog and this step's positions; the others wait (lazy
        # following: a request the adaptive plan does not draft for costs no head forward)
        feats, ids, slots, starts, lens, row_of = [], [], [], [], [], []
        for b, (first, row_feats, row_ids) in chunks.items():
            slot = int(inputs.slots[b])
            if wanted[b] <= 0:
                self._hold(slot, first, row_feats, row_ids)
                continue
            held = self.backlog.pop(slot, None)
            if held is not None and held[0] + len(held[2]) == first:  # (a gap would only weaken drafts)
                first, row_feats, row_ids = held[0], torch.cat([*held[1], row_feats]), held[2] + row_ids
            feats.append(row_feats)
            ids.extend(row_ids)
            slots.append(slot)
            starts.append(first)
            lens.append(len(row_ids))
            row_of.append(b)
        if not slots:
            return flat_drafts(drafts)
        rows = np.array(row_of, dtype=np.int64)
        current = torch.zeros(0, dtype=torch.long, device=self.device)
        produced = [tokens[end - n : end].tolist() for end, n in zip(ends.tolist(), counts.tolist())]
        masked = inputs.draft_masked if masks is not None and inputs.draft_masked is not None else None
        draws = self.sampling.draws(inputs.temperature)
        graph = self.graphs is not None and self.graphs.fits(rows, wanted, draws, produced)
        if masks is not None and masked is not None and not graph:  # draft 0's masks, filled during the follow run
            local = post_masks(rows, masked, produced, 0, masks)
        follow = ForwardBatch.create(np.array(ids), slots, starts, lens, np.ones(len(slots), dtype=np.int32))
        out, logits = self.head.forward(torch.cat(feats), follow.token_ids, follow, self.kv)
        if graph:
            assert self.graphs is not None
            # greedy rows: every draft step in one fixed-shape graph, grammar waits included
            chains = self.graphs.run(
                inputs.step, rows, last_position, inputs.slots, wanted, masked, produced, (out, logits)
            )
            for i, b in enumerate(rows.tolist()):
                drafts[b] = chains[: wanted[b], i].tolist()
            return flat_drafts(drafts)
        for step in range(int(wanted.max(initial=0))):
            if step > 0:
                live = wanted[rows] > step
                keep = torch.from_numpy(live).to(self.device)
                rows, out, current = rows[live], out[keep], current[keep]
                batch_step = ForwardBatch.create(
                    current.cpu().numpy(),
                    inputs.slots[rows],
                    last_position[rows] + step,
                    np.ones(len(rows), dtype=np.int32),
                    np.ones(len(rows), dtype=np.int32),
                )
                if masks is not None and masked is not None:  # (filled during the head's forward)
                    local = post_masks(rows, masked, [p + d for p, d in zip(produced, drafts)], step, masks)
                out, logits = self.head.forward(out, batch_step.token_ids, batch_step, self.kv)
            if masks is not None and masked is not None:
                apply_masks(logits, local, step, masks, self._apply_mask)
            current = self.sampling.choose(logits, rows, inputs, counts, step, self.head.to_target)
            for b, token in zip(rows.tolist(), current.tolist()):
                drafts[b].append(int(token))
        return flat_drafts(drafts)

    def _apply_mask(self, logits: torch.Tensor, local: np.ndarray, bitmask: np.ndarray) -> None:
        """Target-vocabulary bitmask rows on draft-vocabulary logits rows, read through ``d2t``.
        Where the grammar allows nothing in the draft vocabulary the row drafts anyway (argmax of
        -inf rows is 0): the scheduler's check refuses that draft."""
        words = torch.from_numpy(
            np.asarray(bitmask)[:, self._mask_word.numpy()]
        )  # a copy: the ring's rows are read-only
        allowed = (((words >> self._mask_bit) & 1).bool() & self._mask_inside).to(logits.device)
        index = torch.from_numpy(local.astype(np.int64)).to(logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


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
    """The head's attention/MLP shape: its config.json where it says, else the target's."""
    heads = int(config.get("num_attention_heads", target.num_heads))
    hidden = int(config.get("hidden_size", target.hidden_size))
    return dataclasses.replace(
        target,
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
    import copy

    config = copy.deepcopy(target_hf_config)
    config.head_dim = head.head_dim
    config.num_attention_heads = head.num_heads
    config.hidden_size = head.hidden_size
    return config


def _whole_embedding(target: LlamaModel, target_dir: Path) -> tuple[Weight, Weight]:
    """Under TP the target's embedding is sharded by vocabulary; the head on rank 0 reads it whole
    from the checkpoint (no collective: the other ranks do not run the head)."""
    from guidespec.worker.checkpoint import ShardReader

    reader = ShardReader(target_dir)
    embed = pack(reader.get("model.embed_tokens.weight").to(target.dtype).to(target.device))
    if target.cfg.tie_word_embeddings or not reader.has("lm_head.weight"):
        return embed, embed
    return embed, pack(reader.get("lm_head.weight").to(target.dtype).to(target.device))
