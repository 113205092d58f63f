"""The GPU bitmask kernel (Triton): bitmask row ``i`` applied to logits row ``rows[i]``.

xgrammar's ``apply_token_bitmask_inplace`` wants the bitmask aligned with the logits (row r of
one masks row r of the other) and takes the guided rows as a Python list; ours reads the step's
row map as it comes from the mask arena (a request's verify positions are several rows, and
unguided rows are simply absent), so no aligned copy is made and the launch is the same whatever
rows are guided. One program per (mapped row, block of ``BLOCK`` tokens); fp32, bf16 or fp16
logits. With ``TRITON_INTERPRET=1`` it runs on CPU tensors (how CI tests it against NumPy).
"""

from __future__ import annotations

from typing import Any

import torch

BLOCK = 1024

try:
    import triton
    import triton.language as tl
except ImportError:  # torch ops stand in (worker/mask.py)
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _apply_rows(
        logits_ptr,
        logits_stride,
        bitmask_ptr,
        num_words,
        rows_ptr,
        vocab_size,  # type: ignore[no-untyped-def]
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0)
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < vocab_size
        row = tl.load(rows_ptr + i).to(tl.int64)
        words = tl.load(bitmask_ptr + i * num_words + offsets // 32, mask=inside, other=-1)
        forbidden = ((words >> (offsets % 32)) & 1) == 0
        tl.store(logits_ptr + row * logits_stride + offsets, float("-inf"), mask=inside & forbidden)


def apply_rows(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: ``logits[rows[i], t] = -inf`` where bit ``t`` of ``bitmask[i]`` is clear.
    logits [R, V] (last dim contiguous); rows [N] int64 and bitmask [N, ceil(V/32)] int32, on
    logits' device."""
    if rows.shape[0] == 0:
        return
    if triton is None:
        raise RuntimeError("triton is not installed")
    if logits.stride(-1) != 1 or not bitmask.is_contiguous() or not rows.is_contiguous():
        raise ValueError("apply_rows needs contiguous rows of logits, a contiguous bitmask and row map")
    vocab = logits.shape[-1]
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words cannot cover a vocabulary of {vocab}")
    grid: Any = (rows.shape[0], triton.cdiv(vocab, BLOCK))
    _apply_rows[grid](logits, logits.stride(0), bitmask, bitmask.shape[1], rows, vocab, BLOCK=BLOCK)
