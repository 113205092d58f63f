"""Early closing's narrowing of a step's rows in one call (``narrowing.c`` and its NumPy twin):
held to a row-by-row definition on random rows, classes, banned sets and probes."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guidespec.bitmask import bitmask_row
from guidespec.scheduler.grammar import narrowing
from guidespec.scheduler.grammar.narrowing import ASK, KEPT, NARROWED, UNBANNED, Banned, Probe, Tiers

IMPLEMENTATIONS = [
    pytest.param(
        narrowing.narrow_rows,
        id="c",
        marks=pytest.mark.skipif(narrowing.library() is None, reason="no C compiler: narrowing.c is not built"),
    ),
    pytest.param(
        lambda bitmask, rows, tiers, banned=None, probe=None: narrowing._narrow_rows_numpy(
            bitmask, np.asarray(rows, dtype=np.int64), tiers, banned, probe
        ),
        id="numpy",
    ),
]


def _bits(row: np.ndarray) -> int:
    return int(np.bitwise_count(row.view(np.uint32)).sum())


def _by_definition(
    bitmask: np.ndarray,
    rows: list[int],
    tiers: list[np.ndarray],
    banned: list[list[int] | None],
    probe: np.ndarray | None,
) -> tuple[np.ndarray, list[int]]:
    """Row by row, whole rows: the first class the row allows, else all but its banned tokens where
    that leaves any; a change where the probe's tokens are not two or more is asked about."""
    out = bitmask.copy()
    status = []
    width = bitmask.shape[1]
    for r, tokens in zip(rows, banned):
        row = out[r]
        free = probe is None or _bits(row & probe) >= 2
        hit = next((tier for tier in tiers if (row & tier).any()), None)
        if hit is not None:
            new, told = row & hit, NARROWED
        elif tokens is not None:
            new, told = row & ~bitmask_row(tokens, width * 32), UNBANNED
            if not new.any():
                new, told = row, KEPT
        else:
            new, told = row, KEPT
        if (new != row).any() and not free:
            told = ASK
        else:
            out[r] = new
        status.append(told)
    return out, status


@st.composite
def _cases(draw: Any) -> tuple[Any, ...]:
    width = draw(st.sampled_from([1, 3, 16, 17, 40]))
    n = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bitmask = rng.integers(-(2**31), 2**31, size=(n + 2, width + 3)).astype(np.int32)
    bitmask[rng.random(bitmask.shape) < draw(st.sampled_from([0.0, 0.5, 0.9, 0.99]))] = 0
    if draw(st.booleans()):
        bitmask = bitmask[:, :width]  # (rows further apart than their width: the mask arena's rows)
    else:
        bitmask = np.ascontiguousarray(bitmask[:, :width])
    rows = [int(r) for r in rng.permutation(n + 2)[:n]]

    def sparse_row(count: int) -> np.ndarray:
        tokens = rng.choice(width * 32, size=min(count, width * 32), replace=False)
        return bitmask_row([int(t) for t in tokens], width * 32)

    tiers = [sparse_row(draw(st.integers(1, 12))) for _ in range(draw(st.integers(0, 2)))]
    banned: list[list[int] | None] = []
    for r in rows:
        if draw(st.booleans()):
            banned.append(None)
            continue
        allowed = np.flatnonzero(np.unpackbits(bitmask[r].view(np.uint8), bitorder="little"))
        picks = list(rng.choice(allowed, size=min(len(allowed), draw(st.integers(0, 4))), replace=False))
        banned.append(sorted({int(t) for t in picks} | {int(rng.integers(0, width * 32))}))
    probe = sparse_row(draw(st.integers(1, 40))) if draw(st.booleans()) else None
    return bitmask, rows, tiers, banned, probe


@pytest.mark.parametrize("narrow_rows", IMPLEMENTATIONS)
@settings(max_examples=400, deadline=None)
@given(case=_cases())
def test_rows_are_narrowed_as_one_by_one_whole_rows_would_be(narrow_rows: Callable[..., Any], case: Any) -> None:
    """Every row to its first class allowed, else its banned tokens cleared where others are left;
    with a probe, the rows it would change that allow fewer than two probe tokens are told ASK
    and left. Rows not listed, and words beyond a row's width, are never written."""
    bitmask, rows, tiers, banned, probe = case
    expected, status = _by_definition(bitmask, rows, tiers, banned, probe)
    whole = bitmask.base.copy() if bitmask.base is not None else None
    told = narrow_rows(
        bitmask,
        rows,
        Tiers(tiers),
        [None if tokens is None else Banned(tokens) for tokens in banned],
        None if probe is None else Probe(probe),
    )
    assert list(told) == status
    assert np.array_equal(bitmask, expected)
    if whole is not None:
        assert np.array_equal(bitmask.base[:, bitmask.shape[1] :], whole[:, bitmask.shape[1] :])


@pytest.mark.parametrize("narrow_rows", IMPLEMENTATIONS)
def test_the_default_vocabularys_brackets_go_before_its_commas(narrow_rows: Callable[..., Any]) -> None:
    """The classes outside a string on the default model's vocabulary: a bracket over a comma, a
    comma where no bracket; a row with neither is left, and so are the rows not listed."""
    from transformers import AutoTokenizer

    from guidespec.model_files import resolve_model_dir
    from guidespec.scheduler.grammar.closing import ClosingTokens

    closing = ClosingTokens.from_tokenizer(AutoTokenizer.from_pretrained(resolve_model_dir(None)), 49152)
    rng = np.random.default_rng(0)
    brackets, commas = np.flatnonzero(_unpacked(closing.outside)), np.flatnonzero(_unpacked(closing.ending))
    bitmask = np.zeros((40, closing.outside.shape[0]), dtype=np.int32)
    for i in range(len(bitmask)):
        picks = [int(t) for t in rng.integers(3, 49152, size=20)]
        picks += [int(brackets[i % len(brackets)])] if i % 3 == 0 else []
        picks += [int(commas[i % len(commas)])] if i % 2 == 0 else []
        bitmask[i] = bitmask_row(picks, 49152)
    rows = list(range(1, 40, 2))  # every other row: the rest stay as they are
    expected = bitmask.copy()
    for i in rows:
        for tier in (closing.outside, closing.ending):
            if (expected[i] & tier).any():
                expected[i] &= tier
                break
    told = list(narrow_rows(bitmask, rows, closing.tiers_outside))
    assert np.array_equal(bitmask, expected)
    assert told == [NARROWED if (expected[i] & closing.tiers_outside.union).any() else KEPT for i in rows]
    assert NARROWED in told and KEPT in told


def _unpacked(row: np.ndarray) -> np.ndarray:
    return np.unpackbits(row.view(np.uint8), bitorder="little")


@pytest.mark.skipif(narrowing.library() is None, reason="no C compiler: narrowing.c is not built")
def test_the_c_narrowing_writes_nothing_outside_the_bitmask() -> None:
    """Memory safety beside the NumPy twin's IndexError: a row index past the bitmask, or banned
    tokens past its rows' width, leave everything as it was (KEPT)."""
    memory = np.full((4, 2), -1, dtype=np.int32)
    bitmask = memory[:2]  # (rows 2 and 3 of the same memory lie past it)
    tiers = Tiers([bitmask_row([5], 64)])
    told = narrowing.narrow_rows(bitmask, [0, 2, 3], tiers)
    assert list(told) == [NARROWED, KEPT, KEPT]
    assert (memory[1:] == -1).all() and memory[0].tolist() == [32, 0]
    told = narrowing.narrow_rows(bitmask, [1], Tiers([]), [Banned([3, 200])])
    assert list(told) == [KEPT] and (memory[1] == -1).all()
