"""The token bitmask, as every process sees it: int32 ``[rows, bitmask_width(vocab)]``, bit ``j``
of word ``w`` set meaning token ``32 * w + j`` is allowed (tokens past the vocabulary are 0).

The scheduler fills rows (``grammar_backends``), the broadcast carries them (``ipc``: the ring or
the mask arena), the workers apply them (``worker/mask.py``). These are the layout's helpers,
numpy only, for both sides.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def bitmask_row(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """A packed bitmask row (bit i of word i // 32) allowing exactly ``token_ids``. The words are
    set directly: a row of a few tokens costs its words' zeroing, not a byte per token of the
    vocabulary (262,144 at Gemma 3's) packed into bits."""
    row = np.zeros(bitmask_width(vocab_size), dtype=np.uint32)
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if len(ids):  # (a negative id counts from the row's end, as an index would)
        np.bitwise_or.at(row, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
    return row.view(np.int32)


_SPARSE_WORDS = 48  # rows with more nonzero words than this are unpacked whole


def allowed_ids(row: np.ndarray, vocab_size: int | None = None, limit: int | None = None) -> np.ndarray:
    """The token ids a packed bitmask row allows, ascending (below ``vocab_size`` where given; the
    first ``limit`` of them where given). Only the row's nonzero words are unpacked: a grammar's
    row is often a few tokens (a name, a closing bracket), and then this costs a few µs."""
    words = np.ascontiguousarray(row).view(np.uint32)
    nonzero = np.flatnonzero(words)
    if limit is not None:
        nonzero = nonzero[:limit]  # every nonzero word holds at least one id
    if len(nonzero) > _SPARSE_WORDS:
        ids = np.flatnonzero(np.unpackbits(words[: nonzero[-1] + 1].view(np.uint8), bitorder="little"))
    else:
        bits = np.unpackbits(words[nonzero].view(np.uint8), bitorder="little").reshape(len(nonzero), 32)
        word, bit = np.nonzero(bits)
        ids = nonzero[word] * 32 + bit
    if vocab_size is not None:
        ids = ids[ids < vocab_size]
    return ids if limit is None else ids[:limit]


def allowed_counts(bitmask: np.ndarray) -> np.ndarray:
    """[R] int64: how many bits each bitmask row sets (tokens past the vocabulary included)."""
    return np.bitwise_count(np.asarray(bitmask).view(np.uint32)).sum(axis=1, dtype=np.int64)
