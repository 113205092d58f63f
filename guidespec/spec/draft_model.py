"""The draft model (two-model speculation), run by rank 0 of the workers.

The draft model follows the target: every step it runs the same tokens at the same positions
through its own KV cache (same slots), so its cache holds every position the target's does —
rejected drafts included, overwritten later exactly as the target's are; no rewind is needed.
After the target's tokens are verified, it proposes the next step's drafts greedily: it feeds
each row's newest token, takes the argmax, feeds that, and so on, ``draft_lens[b]`` times.
The proposals go back with the step's outputs; the scheduler checks them against the grammar,
puts them in the next step's row, and the target verifies them there.

Draft steps of guided rows are constrained (``draft_masked``): before choosing draft ``j`` rank 0
sends the row's tokens past its final ones up to the scheduler, which owns the grammar, and
waits for that draft step's mask over the ring (``masks``). Drafts are argmax choices, so for
rejection sampling their q is one-hot (exact, see ``verify.py``). Not here yet: sampled drafts
with their q.

Draft models: ``"self"`` (the target's own weights: every greedy draft is accepted; a test of
the mechanics, not a speed-up), ``"layers:N"`` (the target's first N layers with its final norm
and LM head: no extra weights to read, weak drafts without training), or a folder holding a
smaller model with the same tokenizer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from guidespec.config import ModelConfig
from guidespec.protocol import StepInputs
from guidespec.worker.checkpoint import load_hf_config
from guidespec.worker.mask import apply_bitmask
from guidespec.worker.model import ForwardBatch, LlamaModel
from guidespec.worker.tp import TPInfo

# (draft index, batch rows, each row's tokens past its final ones) -> bitmask rows [R, V/32]
MaskSource = Callable[[int, np.ndarray, list[list[int]]], np.ndarray]


class DraftRunner:
    def __init__(self, spec: str, target_dir: Path, dtype: torch.dtype, max_batch_size: int, max_model_len: int,
                 target_vocab_size: int) -> None:
        model_dir, num_layers = _resolve(spec, target_dir)
        hf_config = load_hf_config(model_dir)
        cfg = ModelConfig.from_hf(hf_config)
        if cfg.vocab_size != target_vocab_size:
            raise ValueError(f"draft model {spec!r} has a vocabulary of {cfg.vocab_size}, the target {target_vocab_size}")
        if num_layers is not None:
            if not 1 <= num_layers <= cfg.num_layers:
                raise ValueError(f"draft model {spec!r}: the target has {cfg.num_layers} layers")
            cfg = dataclasses.replace(cfg, num_layers=num_layers)
        self.max_model_len = max_model_len
        self.model = LlamaModel(cfg, TPInfo(), dtype, max_model_len)  # whole, on rank 0 alone
        self.model.load(model_dir, hf_config, show_progress=False)
        self.kv = self.model.create_kv_cache(max_batch_size)

    capture = None  # no target features needed (an EAGLE head needs them: eagle.py)

    def follow(self, batch: ForwardBatch, features: torch.Tensor | None = None) -> None:
        """Run the step's tokens through the draft model: its cache keeps the target's positions."""
        self.model.forward(batch, self.kv)

    def propose(self, inputs: StepInputs, tokens: np.ndarray, counts: np.ndarray,
                masks: MaskSource | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Greedy drafts after each row's last produced token: (flat tokens, per-row counts).

        Row b's first logits row sits at position ``start + num_new - num_logits``; it produced
        ``counts[b]`` tokens, so its newest token goes at that position plus ``counts[b]``.
        """
        assert inputs.draft_lens is not None
        ends = np.cumsum(counts)
        first_logits = inputs.start_positions + inputs.num_new_tokens - inputs.num_logits
        positions = first_logits + counts
        wanted = np.minimum(inputs.draft_lens, self.max_model_len - 1 - positions)
        wanted[counts == 0] = 0
        rows = np.flatnonzero(wanted > 0)
        drafts: list[list[int]] = [[] for _ in range(inputs.batch_size)]
        current = tokens[ends[rows] - 1].astype(np.int64) if len(rows) else np.zeros(0, dtype=np.int64)
        for step in range(int(wanted.max(initial=0))):
            live = wanted[rows] > step
            rows, current = rows[live], current[live]
            batch = ForwardBatch.create(current, inputs.slots[rows], positions[rows] + step,
                                        np.ones(len(rows), dtype=np.int32), np.ones(len(rows), dtype=np.int32))
            logits = self.model.compute_logits(self.model.forward(batch, self.kv))
            assert logits is not None
            if masks is not None and inputs.draft_masked is not None:
                produced = [tokens[end - n : end].tolist() for end, n in zip(ends.tolist(), counts.tolist())]
                _constrain(logits, rows, inputs.draft_masked, [p + d for p, d in zip(produced, drafts)], step, masks)
            current = logits.argmax(dim=-1).numpy()
            for b, token in zip(rows.tolist(), current.tolist()):
                drafts[b].append(int(token))
        flat = np.array([t for row in drafts for t in row], dtype=np.int32)
        return flat, np.array([len(row) for row in drafts], dtype=np.int32)


def _constrain(logits: torch.Tensor, rows: np.ndarray, draft_masked: np.ndarray, sequences: list[list[int]],
               draft_index: int, masks: MaskSource) -> None:
    """Mask the draft logits of the guided rows (``logits[i]`` is batch row ``rows[i]``) with the
    scheduler's masks for their grammar after ``sequences[b]`` (the row's tokens past its final ones)."""
    local = np.flatnonzero(draft_masked[rows])
    if len(local):
        batch_rows = rows[local]
        bitmask = masks(draft_index, batch_rows.astype(np.int32), [sequences[b] for b in batch_rows.tolist()])
        apply_bitmask(logits, local.astype(np.int32), bitmask)


def _resolve(spec: str, target_dir: Path) -> tuple[Path, int | None]:
    if spec == "self":
        return target_dir, None
    if spec.startswith("layers:"):
        try:
            return target_dir, int(spec.removeprefix("layers:"))
        except ValueError:
            raise ValueError(f"draft model {spec!r}: expected layers:N") from None
    return Path(spec), None  # a folder, resolved by the client
