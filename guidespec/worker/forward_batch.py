"""A forward's batch: which slots run which new tokens from which positions (:class:`ForwardBatch`),
and its rows grouped by new-token count for attention (:class:`AttentionGroup`). Built by the
worker from a step's inputs; read by the target model, the drafters and the graphs."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch


@dataclass
class AttentionGroup:
    """Rows that run the same number of new tokens ``n``: attended together in one call."""

    rows: list[int]
    slots: list[int]
    token_index: torch.Tensor | None  # flat token indices, None when the group is the whole batch
    num_new_tokens: int
    length: int  # keys to read: max start + n
    slot_ids: torch.Tensor  # [B] int32, as ``slots`` (for kernels.cache_attention)
    starts: torch.Tensor  # [B] int32: each row's first new position
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """[B, 1, n, length] bool (True = attend), None when nothing is masked; built once per
        step, and only where torch attends (the C kernel needs none)."""
        if len(self.rows) == 1 and self.num_new_tokens == 1:
            return None
        return (self._keys()[None, None, :] <= self._query_positions()[:, :, None])[:, None]

    def mask_within(self, window: int | None) -> torch.Tensor | None:
        """:attr:`mask` of a sliding-window layer: a query at q attends the keys k with
        q - window < k <= q (transformers' sliding mask); the causal mask where no query reaches
        past its window."""
        if window is None or self.length <= window:
            return self.mask
        if window not in self._window_masks:
            query_pos = self._query_positions()[:, :, None]
            keys = self._keys()[None, None, :]
            self._window_masks[window] = ((keys <= query_pos) & (keys > query_pos - window))[:, None]
        return self._window_masks[window]

    def _query_positions(self) -> torch.Tensor:  # [B, n]
        return self.starts.long()[:, None] + torch.arange(self.num_new_tokens, device=self.starts.device)[None]

    def _keys(self) -> torch.Tensor:
        return torch.arange(self.length, device=self.starts.device)


@dataclass
class ForwardBatch:
    """Row ``i`` runs ``num_new_tokens[i]`` tokens of slot ``slots[i]`` from ``start_positions[i]``.

    ``token_ids`` and ``positions`` are flat, row after row; ``logits_indices`` picks the
    flat positions whose logits are wanted.
    """

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: list[int]
    start_positions: list[int]
    num_new_tokens: list[int]
    logits_indices: torch.Tensor  # [R] int64
    slot_of_token: torch.Tensor = field(init=False)  # [T] int64
    groups: list[AttentionGroup] = field(init=False)

    def __post_init__(self) -> None:
        # (NumPy: torch's CPU repeat_interleave runs an OpenMP region, a wake-up of its team per step)
        self.slot_of_token = torch.from_numpy(np.repeat(np.asarray(self.slots, np.int64), self.num_new_tokens))
        self.groups = _attention_groups(self)

    def to(self, device: torch.device | str) -> ForwardBatch:
        """This batch with its tensors on ``device`` (itself on the CPU)."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        moved = copy.copy(self)
        for name in ("token_ids", "positions", "logits_indices", "slot_of_token"):
            setattr(moved, name, getattr(self, name).to(device, non_blocking=True))
        moved.groups = [
            dataclasses.replace(
                g,
                token_index=None if g.token_index is None else g.token_index.to(device, non_blocking=True),
                slot_ids=g.slot_ids.to(device, non_blocking=True),
                starts=g.starts.to(device, non_blocking=True),
            )
            for g in self.groups
        ]
        return moved

    def advanced(self, token_ids: np.ndarray) -> ForwardBatch:
        """This batch of decode rows (a token each, each row's logits: what a StepNext follows),
        each row one position on with ``token_ids``: what :meth:`create` makes of the next step's
        arrays, from this one's (64 rows: ~10 µs against ~30)."""
        (group,) = self.groups
        assert group.num_new_tokens == 1 and self.logits_indices.shape[0] == len(self.slots)
        advanced = object.__new__(ForwardBatch)  # (copy.copy's reduce protocol: a few µs more)
        advanced.__dict__.update(
            self.__dict__,
            token_ids=torch.from_numpy(np.asarray(token_ids, dtype=np.int64)),
            positions=torch.from_numpy(self.positions.numpy() + 1),  # (NumPy's add: a µs less than torch's)
            start_positions=[start + 1 for start in self.start_positions],
            groups=[
                AttentionGroup(
                    group.rows,
                    group.slots,
                    None,
                    1,
                    group.length + 1,
                    group.slot_ids,
                    torch.from_numpy(group.starts.numpy() + 1),
                )
            ],
        )
        return advanced

    @classmethod
    def create(cls, token_ids, slots, start_positions, num_new_tokens, num_logits) -> ForwardBatch:  # type: ignore[no-untyped-def]
        """From a step's arrays (NumPy: a step's host work is no Python loop over its tokens)."""
        starts = np.asarray(start_positions, np.int64)
        counts = np.asarray(num_new_tokens, np.int64)
        nlog = np.asarray(num_logits, np.int64)
        ends = np.cumsum(counts)
        if (counts == 1).all():  # decode rows: a token each
            positions = starts
            logits_indices = np.flatnonzero(nlog)
        else:
            # each token's row, and its index within the row: position = row start + that index
            row_of_token = np.repeat(np.arange(len(counts)), counts)
            within = np.arange(int(counts.sum())) - (ends - counts)[row_of_token]
            positions = starts[row_of_token] + within
            row_of_logit = np.repeat(np.arange(len(nlog)), nlog)
            within_logits = np.arange(int(nlog.sum())) - (np.cumsum(nlog) - nlog)[row_of_logit]
            logits_indices = (ends - nlog)[row_of_logit] + within_logits
        return cls(
            token_ids=torch.from_numpy(np.asarray(token_ids, dtype=np.int64)),
            positions=torch.from_numpy(np.ascontiguousarray(positions)),
            slots=np.asarray(slots).tolist(),
            start_positions=starts.tolist(),
            num_new_tokens=counts.tolist(),
            logits_indices=torch.from_numpy(np.ascontiguousarray(logits_indices, dtype=np.int64)),
        )


def _attention_groups(batch: ForwardBatch) -> list[AttentionGroup]:
    """Group rows by new-token count (each group's causal mask is built on first use)."""
    counts = batch.num_new_tokens
    if counts and counts.count(counts[0]) == len(counts):  # every row alike (decode steps): the batch's own arrays
        n = counts[0]
        # (torch.from_numpy: torch.tensor of a list costs a few µs more, a step's share at batch 1)
        starts = torch.from_numpy(np.array(batch.start_positions, dtype=np.int32))
        length = max(batch.start_positions) + n
        slot_ids = torch.from_numpy(np.array(batch.slots, dtype=np.int32))
        return [AttentionGroup(list(range(len(counts))), batch.slots, None, n, length, slot_ids, starts)]
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    by_count: dict[int, list[int]] = {}
    for row, count in enumerate(counts):
        by_count.setdefault(count, []).append(row)
    groups = []
    for n, rows in by_count.items():
        starts = torch.tensor([batch.start_positions[r] for r in rows])
        length = int(starts.max()) + n
        index = None
        if len(by_count) > 1:
            index = torch.cat([torch.arange(offsets[r], offsets[r + 1]) for r in rows])
        slots = [batch.slots[r] for r in rows]
        groups.append(
            AttentionGroup(
                rows, slots, index, n, length, torch.tensor(slots, dtype=torch.int32), starts.to(torch.int32)
            )
        )
    return groups
