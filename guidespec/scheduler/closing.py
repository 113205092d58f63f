"""Early closing of JSON outputs: a guided output that loops, or nears ``max_tokens``, is steered
to its end instead of being cut mid-value.

A small model under a JSON grammar can fall into a cycle (``"water", "water", ...``) that the
grammar happily allows until ``max_tokens`` cuts it, and a cut JSON document is invalid. While
a request is *closing*, its bitmask row is intersected with the *closing tokens* — tokens made
only of ``"``, ``]``, ``}`` (and spaces) — wherever the grammar allows one of them; where it
allows none (a required property is still missing, a string is below its minLength) the row is
left as the grammar made it and the model writes on. The grammar alone still decides validity:
the intersection never allows a token the grammar refused. (Preferring short values where a
value must come was tried and reverted: where the string scanner misses a quote it forced
digits inside a string until ``max_tokens``.)

A request starts closing when

- its last tokens repeat a cycle: for some period ``p`` the last ``max(2p, min_span)`` tokens
  equal the ``p`` tokens before them (three or more copies of the cycle), or
- fewer than ``reserve`` tokens of its ``max_tokens`` budget are left.

Switch it off per request with ``GuidedDecoding(close_early=False)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from guidespec.grammar_backends.interface import bitmask_row

MAX_PERIOD = 32
MIN_SPAN = 24
_SPACES = ("Ġ", "▁", " ")  # how byte-level and sentencepiece vocabularies spell a space


@dataclass(frozen=True)
class ClosingTokens:
    """Bitmasks (packed int32, bit i of word i // 32) of the tokens that only close JSON values:
    ``in_string`` tokens are a quote then ``]``/``}`` (``"``, ``"]``, ``"}}``), ``outside`` tokens
    are ``]``/``}`` only. Spaces may come before either."""

    in_string: np.ndarray
    outside: np.ndarray

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int) -> "ClosingTokens":
        special = set(tokenizer.all_special_ids)
        in_string, outside = [], []
        for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), vocab_size))))):
            if piece is None or i in special:
                continue
            for space in _SPACES:
                piece = piece.replace(space, "")
            if not piece:
                continue
            if piece[0] == '"' and set(piece[1:]) <= _BRACKETS:
                in_string.append(i)
            elif set(piece) <= _BRACKETS:
                outside.append(i)
        return cls(bitmask_row(in_string, vocab_size), bitmask_row(outside, vocab_size))


_BRACKETS = frozenset("]}")


def budget_reserve(max_tokens: int) -> int:
    """How many tokens before ``max_tokens`` a JSON output starts closing (required properties
    still to come can take many: 64 was too few for Github_medium o14497)."""
    return min(128, max_tokens // 4)


class RepeatDetector:
    """Finds a cycle at the end of a token sequence, in O(MAX_PERIOD) per token.

    ``runs[p - 1]`` counts how many of the latest tokens equal the token ``p`` places before them;
    the sequence ends in a cycle of period ``p`` once that count reaches ``max(2p, min_span)``.
    """

    def __init__(self, max_period: int = MAX_PERIOD, min_span: int = MIN_SPAN) -> None:
        self.max_period = max_period
        self.thresholds = np.maximum(2 * np.arange(1, max_period + 1), min_span)
        self.history = np.full(max_period, -1, dtype=np.int64)  # the last max_period tokens, newest last
        self.runs = np.zeros(max_period, dtype=np.int64)

    def add(self, token: int) -> bool:
        """Record a token; True if the sequence now ends in a cycle."""
        same = self.history[::-1] == token  # same[p - 1]: the token p places back equals this one
        self.runs = (self.runs + 1) * same
        self.history[:-1] = self.history[1:]
        self.history[-1] = token
        return bool((self.runs >= self.thresholds).any())


class EarlyCloser:
    """One JSON-guided request's closing state: the cycle detector, and once closing, whether the
    output is inside a string (scanned lazily from the text, only while closing)."""

    def __init__(self) -> None:
        self.detector = RepeatDetector()
        self.tokens: list[int] = []
        self.closing = False
        self.reason = ""
        self._scanned = 0
        self._in_string = False
        self._escaped = False

    def add(self, token: int) -> None:
        self.tokens.append(token)
        if self.detector.add(token) and not self.closing:
            self.closing, self.reason = True, "repeat"

    def snapshot(self) -> tuple[Any, ...]:
        d = self.detector
        return (d.history.copy(), d.runs.copy(), len(self.tokens), self.closing, self.reason, self._scanned,
                self._in_string, self._escaped)

    def restore(self, state: tuple[Any, ...]) -> None:
        history, runs, num_tokens, self.closing, self.reason, self._scanned, self._in_string, self._escaped = state
        self.detector.history, self.detector.runs = history, runs
        del self.tokens[num_tokens:]

    def near_budget(self) -> None:
        if not self.closing:
            self.closing, self.reason = True, "budget"

    def in_string(self, tokenizer: Any) -> bool:
        """Whether the output so far ends inside a JSON string."""
        if self._scanned < len(self.tokens):
            for ch in tokenizer.decode(self.tokens[self._scanned :]):
                if self._escaped:
                    self._escaped = False
                elif self._in_string and ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = not self._in_string
            self._scanned = len(self.tokens)
        return self._in_string

    def restrict(self, row: np.ndarray, closing: ClosingTokens, tokenizer: Any) -> bool:
        """Intersect a bitmask row with the tokens that close the current value, in place, if that
        leaves any token; the row is untouched otherwise."""
        both = row & (closing.in_string if self.in_string(tokenizer) else closing.outside)
        if not both.any():
            return False
        row[:] = both
        return True
