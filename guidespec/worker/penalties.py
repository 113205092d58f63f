"""Repetition, frequency and presence penalties, from a per-slot token history on rank 0.

Every token of a sequence passes through a step's inputs once (prompt chunks, then each
sampled token fed back), so the worker keeps, per slot, which tokens occurred (prompt and
output: Hugging Face's repetition penalty) and how often each occurred in the output
(OpenAI's frequency and presence penalties), on the logits' device. A row starting at position 0 resets its slot.
Only requests that ask for a penalty are recorded: they always start at position 0 (the
scheduler gives them no cached prefix), so their history is complete, and the others cost nothing.
A fused step (``worker/drafting/step_graph.py``) records and applies them on its fixed-shape rows
(``update_padded``, ``apply_padded``: no host synchronisation), its padding on the scratch slot,
the last one.
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

    def update_padded(
        self, token_ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, prompt_lens: torch.Tensor
    ) -> None:
        """:meth:`update` for a fused step's tokens [T] (each one's slot, position and its row's
        prompt length, 0 for rows not recorded), none of them at position 0: rows not recorded
        write the scratch slot (the last), which nothing reads."""
        scratch = self.seen.shape[0] - 1
        recorded = prompt_lens > 0
        self.seen.index_put_((torch.where(recorded, slots, scratch), token_ids), torch.ones_like(recorded))
        output = recorded & (positions >= prompt_lens)
        ones = torch.ones_like(token_ids, dtype=torch.int32)
        self.output_counts.index_put_((torch.where(output, slots, scratch), token_ids), ones, accumulate=True)

    def apply_padded(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        repetition: torch.Tensor,
        frequency: torch.Tensor,
        presence: torch.Tensor,
    ) -> torch.Tensor:
        """The penalties on every row of ``logits`` [R, V] (a row without penalties unchanged), as a
        new tensor, without a host synchronisation: a fused step's rows, and :meth:`apply`'s."""
        seen = self.seen.index_select(0, slots) & (repetition != 1)[:, None]
        rep = repetition[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        counts = self.output_counts.index_select(0, slots).to(logits.dtype)
        return logits - (frequency[:, None] * counts + presence[:, None] * (counts > 0).to(logits.dtype))

    def apply(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        repetition: torch.Tensor,
        frequency: torch.Tensor,
        presence: torch.Tensor,
    ) -> None:
        """Penalize ``logits`` [R, V] in place; row r belongs to slot ``slots[r]`` (per-row
        parameters on any device: the rows asking for a penalty go through :meth:`apply_padded`)."""
        active = ((repetition != 1) | (frequency != 0) | (presence != 0)).nonzero().flatten()
        if len(active) == 0:
            return
        device = logits.device
        rows = active.to(device)
        picked = [x[active].to(device) for x in (slots, repetition, frequency, presence)]
        logits[rows] = self.apply_padded(logits[rows], *picked)
