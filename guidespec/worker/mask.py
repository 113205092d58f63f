"""Applying token bitmasks to logits: bit j of word w set means token 32*w + j is allowed.

Only the rows named in ``rows`` are touched (rows of unguided requests are skipped). This is
the CPU path; a GPU kernel will sit behind the same function.
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
