"""The bitmask layout's helpers (``guidespec/bitmask.py``): a row made from token ids allows
exactly them, bit ``j`` of word ``w`` for token ``32 w + j``, at any vocabulary size."""

from __future__ import annotations

import numpy as np
import pytest

from guidespec.bitmask import allowed_counts, allowed_ids, bitmask_row, bitmask_width


def _packed(token_ids: list[int], vocab_size: int) -> np.ndarray:
    """The layout spelled out: one byte per token, packed little-endian into int32 words."""
    bits = np.zeros(bitmask_width(vocab_size) * 32, dtype=np.uint8)
    bits[token_ids] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 300, 49152, 151936, 262144])
def test_bitmask_row_sets_exactly_the_given_tokens(vocab_size: int) -> None:
    rng = np.random.default_rng(vocab_size)
    cases = [[], [0], [vocab_size - 1], sorted(set(rng.integers(0, vocab_size, 40).tolist()))]
    cases.append([int(t) for t in rng.integers(0, vocab_size, 12)] * 2)  # repeated ids
    for ids in cases:
        row = bitmask_row(ids, vocab_size)
        assert row.dtype == np.int32 and row.shape == (bitmask_width(vocab_size),)
        np.testing.assert_array_equal(row, _packed(ids, vocab_size))
        np.testing.assert_array_equal(allowed_ids(row, vocab_size), sorted(set(ids)))
        assert allowed_counts(row[None])[0] == len(set(ids))
    np.testing.assert_array_equal(
        bitmask_row(np.array([0, vocab_size - 1]), vocab_size), bitmask_row((0, vocab_size - 1), vocab_size)
    )


def test_bitmask_row_refuses_a_token_past_its_words() -> None:
    with pytest.raises(IndexError):
        bitmask_row([64], 33)  # 33 tokens: 2 words, bits 0..63
