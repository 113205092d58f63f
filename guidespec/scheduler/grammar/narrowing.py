"""Early closing's narrowing of mask rows, a step's rows in one call: each row kept to the first of
closing's classes it allows, or its banned tokens cleared (``closing.py`` says which classes, and
why). ``narrow_rows`` runs ``narrowing.c``, or its NumPy twin here where there is no C compiler or
``GUIDESPEC_CPU_KERNELS=0``. ``library`` builds and loads closing's C (``narrowing.c``, and the
cycle detector's ``repeats.c``) at first use.

NumPy's per-call cost, not the data, made the narrowing of a step's rows cost more than the
grammar backend's fill of them (a dozen calls of 5-20 µs each for a few words a row): in C one
call narrows them all.
"""

from __future__ import annotations

import array
import ctypes
import struct
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from guidespec import envs, native

KEPT, NARROWED, UNBANNED, ASK = 0, 1, 2, 3  # a row's status (``narrow_rows``)

_NONE = np.zeros(1, dtype=np.int32)  # (an empty argument's pointer)


class Banned:
    """A row's banned tokens as the mask words holding them (ascending) and each word's bits kept:
    a row is unbanned by and-ing those few words. Made at each new cycle of a looping output: in
    plain Python over its few tokens (a NumPy row and its arrays' addresses cost ~15 µs)."""

    def __init__(self, tokens: Iterable[int]) -> None:
        bits: dict[int, int] = {}
        for token in tokens:
            bits[token >> 5] = bits.get(token >> 5, 0) | 1 << (token & 31)
        words = sorted(bits)
        self.words = array.array("i", words)
        self.keep = array.array("I", [~bits[word] & 0xFFFFFFFF for word in words])
        # ``narrowing.c``'s record of them: their addresses and count (``Tiers.at``)
        self.record = struct.pack("qqq", self.words.buffer_info()[0], self.keep.buffer_info()[0], len(words))


class Tiers:
    """Closing's classes in the order a row is narrowed to them: each a whole mask row (int32) and
    the words holding its tokens (a class is a few tokens: the narrowing reads those words alone)."""

    def __init__(self, rows: Sequence[np.ndarray]) -> None:
        self.classes = [(row, np.flatnonzero(row)) for row in rows]
        self.union = np.bitwise_or.reduce(list(rows)) if rows else _NONE[:0]  # any class's token
        self.rows = np.ascontiguousarray(np.stack(rows) if rows else np.zeros((0, 1), np.int32)).view(np.uint32)
        self.words = np.concatenate([_NONE[:0], *(words for _, words in self.classes)]).astype(np.int32)
        self.ends = np.cumsum([len(words) for _, words in self.classes], dtype=np.int64).astype(np.int32)
        # ``narrowing.c``'s arguments (an array's address costs ~2 µs to ask: asked once)
        self.at = (self.rows.ctypes.data, self.words.ctypes.data, self.ends.ctypes.data, len(self.classes))


class Probe:
    """The one-character tokens (``ClosingTokens.singles``) and the words holding them: a row allowing
    two of them has no text its grammar forces next (``forces_nothing``)."""

    def __init__(self, row: np.ndarray) -> None:
        self.row = row
        self.words = np.flatnonzero(row).astype(np.int32)
        run = len(self.words) and self.words[-1] - self.words[0] + 1 == len(self.words)
        self.run = slice(int(self.words[0]), int(self.words[-1]) + 1) if run else None  # (one run: a slice)
        self.at = (self.row.ctypes.data, self.words.ctypes.data, len(self.words))


def narrow_rows(
    bitmask: np.ndarray,
    rows: Sequence[int],
    tiers: Tiers,
    banned: Sequence[Banned | None] | None = None,
    probe: Probe | None = None,
) -> Sequence[int]:
    """Narrow each of ``bitmask``'s ``rows``, in place, to the first of ``tiers`` it allows
    (``NARROWED``); where it allows none, clear its ``banned`` tokens if it allows another
    (``UNBANNED``, also told where it allowed no banned token); else leave it (``KEPT``). Returns
    each row's status.

    With ``probe``, a row that the narrowing would change is left as it is and told ``ASK``
    unless it allows two of the probe's tokens: its grammar may force a text there, which the
    narrowing must not split. The caller asks the grammar and narrows the rows where it forces
    nothing with a second call without ``probe``."""
    n = len(rows)
    lib = library()
    words_apart = bitmask.dtype == np.int32 and bitmask.strides[1] == 4  # (rows of int32 words, strided)
    widths = (tiers.classes and tiers.rows.shape[1] != bitmask.shape[1]) or (
        probe is not None and probe.row.shape[0] != bitmask.shape[1]
    )
    if lib is None or not words_apart or widths:
        return list(_narrow_rows_numpy(bitmask, np.asarray(rows, dtype=np.int64), tiers, banned, probe))
    if not n:
        return array.array("B")
    # (the arguments as array.array: NumPy's conversions and address cost ~2-10 µs each)
    at = array.array("q", rows)
    listed = b"".join([_NO_BAN if b is None else b.record for b in banned]) if banned else _NO_BAN * n
    status = array.array("B", bytes(n))
    lib.closing_narrow_rows(
        bitmask.ctypes.data,
        bitmask.strides[0] // 4,
        bitmask.shape[1],
        bitmask.shape[0],
        at.buffer_info()[0],
        n,
        *tiers.at,
        *(probe.at if probe is not None else (0, 0, 0)),
        listed,
        probe is not None,
        status.buffer_info()[0],
    )
    return status


_NO_BAN = bytes(24)  # (a row with no banned tokens: ``Banned.record``)


def forces_nothing(bitmask: np.ndarray, rows: np.ndarray, probe: Probe) -> np.ndarray:
    """Whether each of ``bitmask``'s ``rows`` surely has no text its grammar forces next: it allows
    two of the one-character tokens ``probe`` holds (``ClosingTokens.probe``). A forced text's first
    character starts every token the grammar allows (the masks are exact: a token allowed is one the
    grammar takes), so at most one of those. False says nothing: the row may force a text or not."""
    if probe.run is not None:
        hits = bitmask[rows, probe.run] & probe.row[probe.run]
    else:
        hits = bitmask[rows[:, None], probe.words] & probe.row[probe.words]
    return np.bitwise_count(hits.view(np.uint32)).sum(axis=1) >= 2


def _narrow_rows_numpy(
    bitmask: np.ndarray, rows: np.ndarray, tiers: Tiers, banned: Sequence[Banned | None] | None, probe: Probe | None
) -> np.ndarray:
    """``narrow_rows`` in NumPy (``narrowing.c``'s reference: the tests hold them equal)."""
    n = len(rows)
    status = np.full(n, KEPT, dtype=np.uint8)
    free = forces_nothing(bitmask, rows, probe) if probe is not None else np.ones(n, dtype=bool)
    total = np.bitwise_count(bitmask[rows].view(np.uint32)).sum(axis=1)
    left = np.arange(n)
    for tier, words in tiers.classes:
        if not len(left):
            break
        both = bitmask[rows[left, None], words] & tier[words]
        hits = np.bitwise_count(both.view(np.uint32)).sum(axis=1)
        hit = hits > 0
        at = left[hit]
        status[at] = NARROWED
        changes = total[at] != hits[hit]
        status[at[changes & ~free[at]]] = ASK
        write = changes & free[at]
        bitmask[rows[at[write]]] = 0
        bitmask[rows[at[write], None], words] = both[hit][write]
        left = left[~hit]
    for i in left.tolist():
        ban = banned[i] if banned is not None else None
        if ban is None:
            continue
        row = bitmask[rows[i]]
        words, keep = np.asarray(ban.words), np.frombuffer(ban.keep, dtype=np.int32)
        gone = int(np.bitwise_count((row[words] & ~keep).view(np.uint32)).sum())
        if total[i] == gone:
            continue  # it allows banned tokens alone (or nothing): they stay
        if gone and not free[i]:
            status[i] = ASK
            continue
        row[words] &= keep
        status[i] = UNBANNED
    return status


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """Early closing's C library (``narrowing.c``, ``repeats.c``), built at first use; None where
    there is no C compiler or ``GUIDESPEC_CPU_KERNELS=0``."""
    if not envs.cpu_kernels_enabled():
        return None
    sources = [Path(__file__).with_name(name) for name in ("narrowing.c", "repeats.c")]
    path = native.build_shared("guidespec-closing", sources, [], ["-O3", "-march=native"], [])
    if path is None:
        return None
    # (PyDLL: a call keeps the GIL. A CDLL call gives it up and must win it back, which behind
    # the scheduler's other threads cost ~2 µs a call: more than the work)
    lib = ctypes.PyDLL(str(path))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.closing_narrow_rows.argtypes = [p, i64, i64, i64, p, i64, p, p, p, i32, p, p, i32, ctypes.c_char_p, i32, p]
    lib.closing_narrow_rows.restype = None
    lib.repeats_bytes.argtypes = []
    lib.repeats_bytes.restype = i64
    lib.repeats_add.argtypes = [p, i32]
    lib.repeats_add.restype = i32
    lib.repeats_add_many.argtypes = [p, p, i32, p]
    lib.repeats_add_many.restype = None
    return lib
