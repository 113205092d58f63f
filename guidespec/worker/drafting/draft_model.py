"""The draft model (two-model speculation), run by rank 0 of the workers.

The draft model follows the target lazily: after a step's tokens are verified, a row asked for
drafts runs its final tokens (the step's non-draft tokens and its accepted drafts, after any
it held back) and its newest token through the draft model's KV cache (same slots, same
positions as the target's) in one chunk, whose last logits give the first draft; a row not
asked for drafts only holds its final tokens back (``backlog``), so while the adaptive plan
does not draft for a request the draft model costs nothing. Positions past the final ones are
overwritten by the next run, so no rewind is needed. Then each further draft feeds the
previous one, ``draft_lens[b]`` times.
The proposals go back with the step's outputs; the scheduler checks them against the grammar,
puts them in the next step's row, and the target verifies them there.

Draft steps of guided rows are constrained (``draft_masked``: how many of a row's, from the
first): rank 0 sends the row's tokens past its final ones up to the scheduler, which owns the
grammar, before draft ``j``'s forward (they do not depend on it), so the scheduler fills that
draft step's masks while the forward runs; rank 0 takes them before choosing draft ``j``
(``masks``: a :class:`MaskSource`). Greedy rows draft the argmax; sampled rows draw each draft
from the draft's own masked distribution q' (the request's temperature, top-k, top-p) and rank 0
keeps q' until the next step verifies those drafts with rejection sampling (``DraftSampling``,
``verify.py``).

With ``graph_grammar`` (``use_graphs``), greedy rows run the newest token's forward and every
draft step as one fixed-shape graph, grammar waits inside (``draft_graph.py``; captured on CUDA,
the same sequence eagerly on the CPU); a draft model with a cache of its own runs the final
tokens before the newest first.

Draft models: ``"int8"`` (the target's weights rounded to int8 with a scale per output row: a
quarter of the bytes to read per draft step with the CPU kernel, and drafts that nearly always
agree with the target), ``"self"`` (the target's own weights: every greedy draft is accepted; a
test of the mechanics, not a speed-up), ``"layers:N"`` (the target's first N layers with its
final norm and LM head: weak drafts without training), or a folder holding a smaller model with
the same tokenizer (on CUDA, ``"int8"`` keeps the rounded values at the model's dtype: there is
no int8 kernel there yet, so it saves nothing). Where the target is whole on rank 0 (TP=1),
``"int8"``, ``"self"`` and ``"layers:N"`` use the target's KV cache (``shared``; ``"self"`` and
``"layers:N"`` its weights too), which the target's forward has already filled for every final
token — so nothing is followed or held back, a proposal runs only the newest token and the
drafts, and a request costs the draft model nothing before its first proposal (no prefill of its
prompt). Draft steps write the cache
past the final positions, which the target's next forward overwrites before reading.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch

from guidespec.config import ModelConfig
from guidespec.cuda_ext.channel import DraftChannel
from guidespec.protocol import StepInputs
from guidespec.model_files import load_hf_config
from guidespec.worker.drafting.draft_graph import DraftGraphs
from guidespec.worker.device import memory_plan
from guidespec.worker.graphs import GraphKey, StaticBuffers, padded_forward
from guidespec.worker.kv_cache import KVCache
from guidespec.worker.mask import apply_bitmask
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.model import LlamaModel
from guidespec.worker.sampler import DRAFT, counter_uniforms, filtered_probs, inverse_cdf
from guidespec.worker.tp import TPInfo


class MaskSource(Protocol):
    """A draft step's grammar masks, in two halves: ``post`` sends the step's rows (batch rows)
    with each one's tokens past its final ones, before the drafter's forward; ``take`` waits for
    their bitmask rows [R, V/32] after it."""

    def post(self, draft_index: int, rows: np.ndarray, sequences: list[list[int]]) -> None: ...

    def take(self, draft_index: int) -> np.ndarray: ...


# (logits [R, V'], logits rows, bitmask rows [n, ceil(V/32)] over the target vocabulary) -> None, in place
MaskApply = Callable[[torch.Tensor, np.ndarray, np.ndarray], None]


class DraftSampling:
    """How rank 0's drafters choose drafts, and the q' they keep for verification.

    Greedy rows take the argmax. Sampled rows draw from q' = the draft logits (masked) under the
    request's temperature, top-k and top-p; q' is kept per KV slot over the target vocabulary,
    and the next step's verification uses it for the rows whose drafts are exactly those tokens
    (the scheduler may cut or replace proposals: other drafts count as one-hot, which is exact
    for them too). Seeded requests draw with `counter_uniforms` of (seed, output index, DRAFT).
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.kept: dict[int, tuple[list[int], list[torch.Tensor]]] = {}  # slot -> (drafts, q' rows [V])
        # every row drafts its argmax, sampled ones too (q' one-hot: nothing kept), where steps
        # fuse: a fused step verifies sampled rows on the device with one-hot q' (step_graph.py)
        self.greedy = False

    def draws(self, temperature: np.ndarray) -> np.ndarray:
        """Each row's temperature as drafting sees it: 0 (argmax) for every row when ``greedy``."""
        return np.zeros_like(temperature) if self.greedy else temperature

    def start(self) -> None:
        self.kept = {}

    def choose(
        self,
        logits: torch.Tensor,
        rows: np.ndarray,
        inputs: StepInputs,
        counts: np.ndarray,
        step: int,
        to_target: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Draft number ``step`` of batch rows ``rows`` from their logits [R, draft vocab]: target ids."""
        chosen = logits.argmax(dim=-1)
        temperature = self.draws(inputs.temperature)[rows]
        sampled = np.flatnonzero(temperature > 0)
        q_rows: dict[int, torch.Tensor] = {}
        if len(sampled):
            ids = None
            if to_target is not None:
                ids = (
                    to_target(torch.arange(logits.shape[1], device=logits.device)).clamp(max=self.vocab_size - 1).cpu()
                )
            probs = filtered_probs(
                logits[torch.from_numpy(sampled)],
                torch.from_numpy(temperature[sampled].astype(np.float32)),
                torch.from_numpy(inputs.top_k[rows[sampled]].astype(np.int64)),
                torch.from_numpy(inputs.top_p[rows[sampled]].astype(np.float32)),
            )
            for i, local in enumerate(sampled.tolist()):
                b = int(rows[local])
                q = probs[i].cpu()  # drawn on the host, kept there until verification
                if not bool(torch.isfinite(q).all()) or float(q.sum()) <= 0:  # nothing allowed: a fixed draft
                    continue
                seed = int(inputs.seeds[b])
                if seed >= 0:  # (DRAFT: numbers apart from verification's)
                    index = int(inputs.sample_index[b]) + int(counts[b]) + step
                    u = torch.from_numpy(counter_uniforms(np.array([seed]), np.array([index]), DRAFT))
                    token = int(inverse_cdf(q[None], u)[0])
                else:
                    token = int(torch.multinomial(q, 1))
                chosen[local] = token
                q_rows[local] = q if ids is None else torch.zeros(self.vocab_size).index_add_(0, ids, q)
        targets = to_target(chosen) if to_target is not None else chosen
        for local, b in enumerate(rows.tolist()):
            if temperature[local] <= 0:
                continue
            slot = int(inputs.slots[b])
            drafts, qs = self.kept.setdefault(slot, ([], []))
            token = int(targets[local])
            drafts.append(token)
            qs.append(q_rows[local] if local in q_rows else _one_hot(token, self.vocab_size))
        return targets

    def draft_probs(self, inputs: StepInputs, drafts: list[np.ndarray]) -> list[torch.Tensor | None] | None:
        """q' for each row whose drafts are the ones proposed for its slot last step (else None).
        The kept q' serve this one step: proposals not verified now are never verified later."""
        kept, self.kept = self.kept, {}
        if not kept:
            return None
        out: list[torch.Tensor | None] = []
        for b, row_drafts in enumerate(drafts):
            row_kept = kept.get(int(inputs.slots[b]))
            n = len(row_drafts)
            if row_kept is None or n == 0 or inputs.temperature[b] <= 0 or row_kept[0][:n] != row_drafts.tolist():
                out.append(None)
            else:
                out.append(torch.stack(row_kept[1][:n]))
        return out


def _one_hot(token: int, size: int) -> torch.Tensor:
    q = torch.zeros(size)
    q[token] = 1.0
    return q


class DraftRunner:
    def __init__(
        self,
        choice: str,
        target_dir: Path,
        dtype: torch.dtype,
        max_batch_size: int,
        max_model_len: int,
        target_vocab_size: int,
        target: tuple[LlamaModel, KVCache] | None = None,
        device: str = "cpu",
    ) -> None:
        model_dir, num_layers, int8 = _resolve(choice, target_dir)
        hf_config = load_hf_config(model_dir)
        cfg = ModelConfig.from_hf(hf_config)
        if cfg.vocab_size != target_vocab_size:
            raise ValueError(
                f"draft model {choice!r} has a vocabulary of {cfg.vocab_size}, the target {target_vocab_size}"
            )
        if num_layers is not None:
            if not 1 <= num_layers <= cfg.num_layers:
                raise ValueError(f"draft model {choice!r}: the target has {cfg.num_layers} layers")
            cfg = dataclasses.replace(cfg, num_layers=num_layers)
        self.max_model_len = max_model_len
        # the target's own first layers, where the target is whole on this rank (TP=1): their
        # weights and their cache are the target's, which already holds every final token
        self.shared = (
            target is not None and model_dir == target_dir and target[0].tp.size == 1 and target[0].dtype == dtype
        )
        if self.shared and target is not None:  # (the second test only narrows the type)
            self.model = target[0].first_layers(cfg.num_layers)
            self.kv = target[1].first_layers(cfg.num_layers)
        else:
            self.model = LlamaModel(cfg, TPInfo(), dtype, max_model_len, device)  # whole, on rank 0 alone
            self.model.load(model_dir, hf_config, show_progress=False)
            self.kv = self.model.create_kv_cache(max_batch_size + 1)  # (the last: the draft graphs' scratch slot)
        if int8:
            self.model = self.model.int8_copy()
        self.sampling = DraftSampling(target_vocab_size)
        self.backlog: dict[int, tuple[int, list[int]]] = {}  # slot -> (first position, final tokens not yet run)
        self._unproposed: list[tuple[int, int, list[int]]] | None = None  # the last step's rows, until propose
        self.max_batch_size, self.vocab_size = max_batch_size, target_vocab_size
        self.graphs: DraftGraphs | None = None  # fixed-shape draft steps, set by use_graphs

    def use_graphs(self, channel: DraftChannel, timeout_s: float, peer_pid: int, capture: bool) -> None:
        """Run greedy draft steps as fixed-shape graphs whose grammar waits are the draft channel's
        C trampolines in stream order (captured CUDA graphs, or on the CPU the same steps eagerly).
        The cache needs a scratch slot: a shared one is the target's, which has one where the
        worker runs graphs."""
        ids = torch.arange(self.vocab_size)
        self.graphs = DraftGraphs(
            ModelDraftSteps(self.model),
            self.kv,
            self.max_batch_size,
            channel,
            timeout_s,
            peer_pid,
            capture,
            (ids >> 5, ids & 31, torch.ones(self.vocab_size, dtype=torch.bool)),
        )

    capture = None  # no target features needed (an EAGLE head needs them: eagle.py)

    def follow(self, batch: ForwardBatch, features: torch.Tensor | None = None) -> None:
        """Note the step's tokens (run lazily, in ``propose``); a previous step that had no
        logits (prefill chunks only: never proposed after) holds all its tokens back. A draft
        model sharing the target's cache has nothing to follow: the target ran them there."""
        if self.shared:
            return
        if self._unproposed is not None:
            for slot, start, ids in self._unproposed:
                self._hold(slot, start, ids)
        offsets = np.concatenate([[0], np.cumsum(batch.num_new_tokens)])
        ids = batch.token_ids.tolist()
        self._unproposed = [
            (slot, start, ids[offsets[i] : offsets[i + 1]])
            for i, (slot, start) in enumerate(zip(batch.slots, batch.start_positions))
        ]

    def _hold(self, slot: int, start: int, ids: list[int]) -> None:
        """Keep final tokens at ``start..`` of ``slot`` for a later run."""
        held = self.backlog.get(slot)
        if start == 0 or held is None or held[0] + len(held[1]) != start:  # a new request, or a gap
            self.backlog[slot] = (start, list(ids))  # (a gap only weakens drafts: the cache keeps older values)
        else:
            held[1].extend(ids)

    @torch.inference_mode()
    def catch_up(self, inputs: StepInputs) -> int:
        """Before a fused step (``step_graph.py``, which follows only the step's own positions):
        run the final tokens of the step's rows held back before it (a row the adaptive plan did
        not draft for, a step without logits), as ``propose`` runs them. The number of tokens run;
        none where the cache is the target's."""
        if self.shared:
            return 0
        if self._unproposed is not None:  # a step that proposed nothing (no logits)
            for slot, start, ids in self._unproposed:
                self._hold(slot, start, ids)
            self._unproposed = None
        ids, slots, starts, lens = [], [], [], []
        for slot, start in zip(inputs.slots.tolist(), inputs.start_positions.tolist()):
            held = self.backlog.pop(slot, None)
            if held is None or held[0] + len(held[1]) != start:  # (a gap: dropped, as propose does)
                continue
            ids.extend(held[1])
            slots.append(slot)
            starts.append(held[0])
            lens.append(len(held[1]))
        if slots:
            self.model.forward(ForwardBatch.create(ids, slots, starts, lens, np.ones(len(slots), np.int32)), self.kv)
        return len(ids)

    def follow_padded(
        self, features: torch.Tensor | None, picks: torch.Tensor, buffers: StaticBuffers, key: GraphKey
    ) -> None:
        """A fused step's follow (``step_graph.py``): a cache of its own takes the step's tokens
        (rejected drafts write past the row's end); a shared one has them from the target's forward."""
        if not self.shared:
            padded_forward(self.model, self.kv, buffers)

    @torch.inference_mode()
    def propose(
        self, inputs: StepInputs, tokens: np.ndarray, counts: np.ndarray, masks: MaskSource | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Drafts after each row's last produced token: (flat tokens, per-row counts).

        Row b's first logits row sits at position ``start + num_new - num_logits``; it produced
        ``counts[b]`` tokens, so its newest token goes at that position plus ``counts[b]``.
        """
        assert inputs.draft_lens is not None
        self._unproposed = None
        ends = np.cumsum(counts)
        offsets = np.concatenate([[0], np.cumsum(inputs.num_new_tokens)])
        first_logits = inputs.start_positions + inputs.num_new_tokens - inputs.num_logits
        positions = first_logits + counts
        wanted = np.minimum(inputs.draft_lens, self.max_model_len - 1 - positions)
        wanted[counts == 0] = 0
        chunks: list[list[int]] = []
        slots, starts, proposing = [], [], []
        for b in range(inputs.batch_size):
            slot, start = int(inputs.slots[b]), int(inputs.start_positions[b])
            m = int(inputs.num_new_tokens[b]) - max(int(inputs.num_logits[b]), 1) + 1  # the row's non-draft tokens
            final = (
                inputs.token_ids[offsets[b] : offsets[b] + m].tolist() + tokens[ends[b] - counts[b] : ends[b]].tolist()
            )
            if wanted[b] <= 0:
                if not self.shared:
                    self._hold(slot, start, final[:-1] if counts[b] else final)  # the newest token starts the next step
                continue
            if self.shared:  # the target's forward wrote the final tokens' keys and values: only the newest is new
                start, final = int(positions[b]), final[-1:]
            else:
                held = self.backlog.pop(slot, None)
                if start > 0 and held is not None and held[0] + len(held[1]) == start:
                    start, final = held[0], held[1] + final
            chunks.append(final)
            slots.append(slot)
            starts.append(start)
            proposing.append(b)
        drafts: list[list[int]] = [[] for _ in range(inputs.batch_size)]
        if not proposing:
            return flat_drafts(drafts)
        rows = np.array(proposing, dtype=np.int64)
        masked = inputs.draft_masked if masks is not None else None
        produced = [tokens[end - n : end].tolist() for end, n in zip(ends.tolist(), counts.tolist())]
        self.sampling.start()
        draws = self.sampling.draws(inputs.temperature)
        if self.graphs is not None and self.graphs.fits(rows, wanted, draws, produced):
            # greedy draws: the newest token's forward and every draft step in one fixed-shape graph,
            # grammar waits included; final tokens before the newest (a cache of its own) run first
            before = [i for i, chunk in enumerate(chunks) if len(chunk) > 1]
            if before:
                batch = ForwardBatch.create(
                    [t for i in before for t in chunks[i][:-1]],
                    [slots[i] for i in before],
                    [starts[i] for i in before],
                    [len(chunks[i]) - 1 for i in before],
                    np.ones(len(before), dtype=np.int32),
                )
                self.model.forward(batch, self.kv)
            newest = np.zeros(inputs.batch_size, dtype=np.int64)
            newest[rows] = [chunk[-1] for chunk in chunks]
            chains = self.graphs.run(inputs.step, rows, positions, inputs.slots, wanted, masked, produced, newest)
            for i, b in enumerate(rows.tolist()):
                drafts[b] = chains[: wanted[b], i].tolist()
            return flat_drafts(drafts)
        batch = ForwardBatch.create(
            [t for chunk in chunks for t in chunk],
            slots,
            starts,
            [len(chunk) for chunk in chunks],
            np.ones(len(rows), dtype=np.int32),
        )
        current = np.zeros(0, dtype=np.int64)
        for step in range(int(wanted.max(initial=0))):
            if step > 0:
                live = wanted[rows] > step
                rows, current = rows[live], current[live]
                batch = ForwardBatch.create(
                    current,
                    inputs.slots[rows],
                    positions[rows] + step,
                    np.ones(len(rows), dtype=np.int32),
                    np.ones(len(rows), dtype=np.int32),
                )
            if masks is not None and masked is not None:  # (the scheduler fills them during the forward)
                local = post_masks(rows, masked, [p + d for p, d in zip(produced, drafts)], step, masks)
            logits = self.model.compute_logits(self.model.forward(batch, self.kv))
            assert logits is not None
            if masks is not None and masked is not None:
                apply_masks(logits, local, step, masks)
            current = self.sampling.choose(logits, rows, inputs, counts, step).cpu().numpy()
            for b, token in zip(rows.tolist(), current.tolist()):
                drafts[b].append(int(token))
        return flat_drafts(drafts)


class ModelDraftSteps:
    """A draft model's draft step for the fixed-shape draft graphs (``draft_graph.GraphDrafter``):
    one token per row through the whole model, no state carried between steps but the cache."""

    forwards_first = True  # draft 0 comes from the newest token's forward, in the graph
    feature_width = 1  # (nothing: the graphs' feature buffer stays unread)

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.device, self.dtype = torch.device(model.device), model.dtype
        self.max_model_len, self.logits_width = model.max_model_len, model.cfg.vocab_size

    def draft_step(
        self,
        features: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv: KVCache,
        key_length: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model.forward_padded(kv, token_ids, positions, slots, slots, 1, key_length)
        logits = self.model.compute_logits(hidden)
        assert logits is not None  # (a draft model is whole on rank 0)
        return features, logits

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids


def flat_drafts(drafts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-row drafts as (flat tokens, per-row counts), as they travel in StepOutputs."""
    return (
        np.array([t for row in drafts for t in row], dtype=np.int32),
        np.array([len(row) for row in drafts], dtype=np.int32),
    )


def post_masks(
    rows: np.ndarray, draft_masked: np.ndarray, sequences: list[list[int]], draft_index: int, masks: MaskSource
) -> np.ndarray:
    """Ask for draft step ``draft_index``'s masks of the guided rows among ``rows`` (batch rows, in
    logits order) whose grammar masks that step (``draft_masked[b]``: how many draft steps, from
    the first), each after ``sequences[b]`` (its tokens past its final ones). Returns their logits
    rows, for :func:`apply_masks`."""
    local = np.flatnonzero(draft_masked[rows] > draft_index)
    if len(local):
        batch_rows = rows[local]
        masks.post(draft_index, batch_rows.astype(np.int32), [sequences[b] for b in batch_rows.tolist()])
    return local


def apply_masks(
    logits: torch.Tensor, local: np.ndarray, draft_index: int, masks: MaskSource, apply: MaskApply = apply_bitmask
) -> None:
    """Take the masks :func:`post_masks` asked for and put them on their logits rows ``local``.
    ``apply`` puts target-vocabulary bitmask rows on logits rows (an EAGLE head with a pruned
    vocabulary reads them through ``d2t``)."""
    if len(local):
        apply(logits, local.astype(np.int32), masks.take(draft_index))


def draft_model_bytes(
    choice: str,
    target_dir: Path,
    target_cfg: ModelConfig,
    dtype: torch.dtype,
    tp_size: int,
    num_slots: int,
    max_model_len: int,
) -> int:
    """What a draft model adds to rank 0's memory: its weights, unless they are the target's
    (``self``, ``layers:N`` at TP=1; ``int8`` keeps a rounded copy), and its cache, unless it is the
    target's (TP=1 and the target's folder)."""
    model_dir, num_layers, int8 = _resolve(choice, target_dir)
    shared = model_dir == target_dir and tp_size == 1
    if shared and not int8:
        return 0
    cfg = target_cfg if model_dir == target_dir else ModelConfig.from_hf(load_hf_config(model_dir))
    if num_layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=max(1, min(num_layers, cfg.num_layers)))
    plan = memory_plan(cfg, dtype, 1, 0 if shared else num_slots, max_model_len, 0)
    return plan.weights + plan.kv_cache


def _resolve(choice: str, target_dir: Path) -> tuple[Path, int | None, bool]:
    """(model folder, layers to keep or None for all, whether int8)."""
    if choice in ("self", "int8"):
        return target_dir, None, choice == "int8"
    if choice.startswith("layers:"):
        try:
            return target_dir, int(choice.removeprefix("layers:")), False
        except ValueError:
            raise ValueError(f"draft model {choice!r}: expected layers:N") from None
    return Path(choice), None, False  # a folder, resolved by the client
