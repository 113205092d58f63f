"""Applying token bitmasks to logits: bit j of word w set means token 32*w + j is allowed.

Only the rows named in ``rows`` are touched (rows of unguided requests are skipped). This is
the CPU path; a GPU kernel will sit behind the same function.

A row whose mask allows exactly one token (the grammar forces it) needs no logits at all: its
masked distribution puts all mass on that token, whatever the model says. ``only_allowed``
finds those rows, so the workers skip their LM head (a fifth of a token's compute for this
model) and the mask, as jump-forward skips the whole step for them.
"""

from __future__ import annotations

import numpy as np
import torch

_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab] bool (True = allowed)."""
    bits = (bitmask[:, :, None] >> _BITS) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, rows: np.ndarray, bitmask: np.ndarray) -> None:
    """Set disallowed tokens of ``logits[rows]`` to -inf, in place."""
    if len(rows) == 0:
        return
    allowed = unpack_bitmask(torch.from_numpy(np.array(bitmask, dtype=np.int32)), logits.shape[-1])
    index = torch.from_numpy(np.asarray(rows, dtype=np.int64))
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def only_allowed(rows: np.ndarray, bitmask: np.ndarray, num_rows: int, vocab_size: int) -> np.ndarray:
    """[num_rows] int64: for each logits row, the one token its mask allows, or -1 (no mask,
    or any other number of tokens allowed)."""
    out = np.full(num_rows, -1, dtype=np.int64)
    if len(rows) == 0:
        return out
    words = np.asarray(bitmask).view(np.uint32)
    single = np.flatnonzero(np.bitwise_count(words).sum(axis=1, dtype=np.int64) == 1)
    if len(single):
        nonzero = words[single] != 0
        word = np.argmax(nonzero, axis=1)
        bit = np.bitwise_count(words[single, word] - np.uint32(1))  # the one set bit's index
        token = 32 * word + bit.astype(np.int64)
        inside = token < vocab_size
        out[np.asarray(rows)[single[inside]]] = token[inside]
    return out
