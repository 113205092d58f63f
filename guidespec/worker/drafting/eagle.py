"""Running an EAGLE draft head beside the target (one-model speculation), on rank 0 of the
workers; the head itself and its files are :mod:`.eagle_head`'s.

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

from pathlib import Path
from typing import Any

import numpy as np
import torch

from guidespec.cuda_ext.channel import DraftChannel
from guidespec.protocol import StepInputs
from guidespec.worker.drafting.draft_graph import DraftGraphs
from guidespec.worker.drafting.draft_model import DraftSampling, MaskSource, apply_masks, flat_drafts, post_masks
from guidespec.worker.drafting.eagle_head import EagleHead, whole_embedding
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.graphs import GraphKey, StaticBuffers
from guidespec.worker.model import LlamaModel


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
            embed, lm_head = whole_embedding(target, target_dir)
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
