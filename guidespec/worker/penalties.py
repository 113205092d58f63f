"""Repetition, frequency and presence penalties, from a per-slot token history on rank 0.

Every token of a sequence passes through a step's inputs once (prompt chunks, then each
sampled token fed back), so the worker keeps, per slot, which tokens occurred (prompt and
output: Hugging Face's repetition penalty) and how often each occurred in the output
(OpenAI's frequency and presence penalties), on the logits' device. A row starting at position 0 resets its slot.
Only requests that ask for a penalty are recorded: they always start at position 0 (the
scheduler gives them no cached prefix), so their history is complete, and the others cost nothing.
"""

from __future__ import annotations

import torch


class TokenHistory:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.seen = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)

    def update(
        self,
        slots: list[int],
        starts: list[int],
        counts: list[int],
        token_ids: torch.Tensor,
        num_prompt_tokens: list[int],
        active: list[bool] | None = None,
    ) -> None:
        """Record the rows' new tokens; ``active``: only those rows' (the others are skipped)."""
        offset = 0
        token_ids = token_ids.to(self.seen.device, non_blocking=True)
        for i, (slot, start, count, prompt_len) in enumerate(zip(slots, starts, counts, num_prompt_tokens)):
            tokens = token_ids[offset : offset + count]
            offset += count
            if active is not None and not active[i]:
                continue
            if start == 0:
                self.seen[slot] = False
                self.output_counts[slot] = 0
            self.seen[slot, tokens] = True
            output_tokens = tokens[max(0, prompt_len - start) :]
            if len(output_tokens):
                self.output_counts[slot].index_add_(0, output_tokens, torch.ones_like(output_tokens, dtype=torch.int32))

    def apply(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        repetition: torch.Tensor,
        frequency: torch.Tensor,
        presence: torch.Tensor,
    ) -> None:
        """Penalize ``logits`` [R, V] in place; row r belongs to slot ``slots[r]``."""
        active = ((repetition != 1) | (frequency != 0) | (presence != 0)).nonzero().flatten()
        for r in active.tolist():
            row, slot = logits[r], int(slots[r])
            rep, freq, pres = float(repetition[r]), float(frequency[r]), float(presence[r])
            if rep != 1:
                seen = self.seen[slot]
                row[seen] = torch.where(row[seen] > 0, row[seen] / rep, row[seen] * rep)
            counts = self.output_counts[slot].to(row.dtype)
            row -= freq * counts + pres * (counts > 0).to(row.dtype)
