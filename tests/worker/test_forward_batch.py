"""A decode batch one position on (``ForwardBatch.advanced``, a StepNext's step) is the batch
``ForwardBatch.create`` makes of the next step's arrays."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from guidespec.worker.forward_batch import ForwardBatch


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 63), st.integers(0, 4000)), min_size=1, max_size=24, unique_by=lambda r: r[0]))
def test_an_advanced_decode_batch_is_the_next_steps_batch(rows: list[tuple[int, int]]) -> None:
    slots = np.array([slot for slot, _ in rows], np.int32)
    starts = np.array([start for _, start in rows], np.int32)
    ones = np.ones(len(rows), np.int32)
    tokens = np.arange(len(rows), dtype=np.int32) * 7
    before = ForwardBatch.create(tokens, slots, starts, ones, ones)
    before.groups[0].mask  # (a cached mask must not follow the batch on)
    advanced = before.advanced(tokens + 1)
    made = ForwardBatch.create(tokens + 1, slots, starts + 1, ones, ones)
    for name in ("token_ids", "positions", "logits_indices", "slot_of_token"):
        assert torch.equal(getattr(advanced, name), getattr(made, name)), name
        assert getattr(advanced, name).dtype == getattr(made, name).dtype, name
    assert (advanced.slots, advanced.start_positions, advanced.num_new_tokens) == (
        made.slots,
        made.start_positions,
        made.num_new_tokens,
    )
    (group,), (expected,) = advanced.groups, made.groups
    assert (group.rows, group.slots, group.token_index, group.num_new_tokens, group.length) == (
        expected.rows,
        expected.slots,
        expected.token_index,
        expected.num_new_tokens,
        expected.length,
    )
    for name in ("slot_ids", "starts"):
        assert (
            torch.equal(getattr(group, name), getattr(expected, name))
            and getattr(group, name).dtype == getattr(expected, name).dtype
        )
    masks = (group.mask, expected.mask)
    assert (masks[0] is None) == (masks[1] is None) and (masks[0] is None or torch.equal(*masks))  # type: ignore[arg-type]
    assert torch.equal(before.positions, torch.from_numpy(starts.astype(np.int64)))  # (the batch before: unchanged)
