"""The token history behind repetition, frequency and presence penalties: a fused step's
fixed-shape update (``update_padded``) and the per-row one leave the history the token lists
say, and the penalties (``apply_padded``, and ``apply`` in place) are those computed row by row
from the token lists, padding and rows without penalties untouched."""

from __future__ import annotations

import torch

from guidespec.worker.penalties import TokenHistory

V, SLOTS = 12, 4  # the last slot: the scratch slot a fused step's padding writes


def test_padded_update_and_apply_equal_the_per_row_ones() -> None:
    torch.manual_seed(0)
    prompts = [[1, 2, 3, 2], [4, 5], [6, 7, 8]]
    rows, padded = TokenHistory(SLOTS, V), TokenHistory(SLOTS, V)
    for history in (rows, padded):  # the prompts (a prefill: start 0, the per-row update)
        history.update([0, 1, 2], [0, 0, 0], [len(p) for p in prompts], torch.tensor(sum(prompts, [])), [4, 2, 3])
    # a decode step of 3 rows in a fused step's layout (2 tokens per row, the second padding):
    # rows 0 and 2 penalized, row 1 not
    new = torch.tensor([2, 9, 5, 9, 3, 9])
    slots = torch.tensor([0, 3, 1, 3, 2, 3])  # (padding tokens on the scratch slot)
    positions = torch.tensor([4, 5, 2, 3, 3, 4])
    prompt_lens = torch.tensor([4, 4, 0, 0, 3, 3])  # (0: a row not recorded)
    rows.update([0, 1, 2], [4, 2, 3], [1, 1, 1], torch.tensor([2, 5, 3]), [4, 2, 3], [True, False, True])
    padded.update_padded(new, slots, positions, prompt_lens)
    # what each slot should hold, from the token lists alone: every recorded token seen, the
    # output's counted (row 1 not penalized: its new token 5 not recorded)
    outputs = [[2], [], [3]]
    seen = torch.tensor([[v in prompt + output for v in range(V)] for prompt, output in zip(prompts, outputs)])
    counts = torch.tensor([[output.count(v) for v in range(V)] for output in outputs], dtype=torch.int32)
    for history in (rows, padded):
        assert torch.equal(history.seen[:3], seen) and torch.equal(history.output_counts[:3], counts)
    logits = torch.randn(6, V) * 3
    logits[0, 7] = float("-inf")  # (a masked token stays masked)
    penalties = torch.tensor([[1.3, 0.5, 0.2]] * 2 + [[1.0, 0.0, 0.0]] * 2 + [[0.8, 0.0, 0.7]] * 2)
    row_slots = torch.tensor([0, 0, 1, 1, 2, 2])
    expected = logits.clone()  # the penalties row by row (HF's repetition, OpenAI's frequency and presence)
    for r in range(6):
        rep, freq, pres = penalties[r].tolist()
        row, slot = expected[r], int(row_slots[r])
        row[seen[slot]] = torch.where(row[seen[slot]] > 0, row[seen[slot]] / rep, row[seen[slot]] * rep)
        row -= freq * counts[slot].float() + pres * (counts[slot] > 0).float()
    got = padded.apply_padded(logits, row_slots, *penalties.unbind(1))
    assert torch.equal(got, expected) and not torch.equal(got, logits)
    assert torch.equal(got[2:4], logits[2:4])  # a row without penalties: unchanged
    in_place = logits.clone()  # the unfused step's call: in place, per-row parameters on the host
    rows.apply(in_place, row_slots, *penalties.unbind(1))
    assert torch.equal(in_place, expected)
