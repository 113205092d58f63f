"""Early closing of JSON outputs: the cycle detector, the closing-token sets, the string scanner,
and the mask restriction never allowing a token the grammar refused."""

from __future__ import annotations

import numpy as np
import pytest

from guidespec.scheduler.closing import ClosingTokens, EarlyCloser, RepeatDetector, budget_reserve
from guidespec.worker.checkpoint import default_model_path, resolve_model_dir


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(default_model_path()))


def _ids(mask: np.ndarray) -> list[int]:
    return np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0].tolist()


def test_detector_fires_on_a_cycle_and_not_on_varied_text() -> None:
    cycle = [5, 6, 7, 8]
    detector = RepeatDetector()
    fired = [detector.add(t) for t in cycle * 10]
    # period 4: fires once 24 tokens (= max(2*4, 24)) equal the ones 4 places before them
    assert fired.index(True) == 4 + 24 - 1
    varied = RepeatDetector()
    rng = np.random.default_rng(0)
    assert not any(varied.add(int(t)) for t in rng.integers(0, 1000, size=2000))
    long_period = RepeatDetector()
    block = list(range(100, 130))  # period 30: needs 2 * 30 repeated tokens, three copies
    assert [long_period.add(t) for t in block * 3].index(True) == 89


def test_detector_resets_when_the_cycle_breaks() -> None:
    detector = RepeatDetector()
    for t in [1, 2] * 12:
        detector.add(t)
    assert not detector.add(3)
    assert not any(detector.add(t) for t in [1, 2] * 5)


def test_closing_tokens_of_the_default_tokenizer(tokenizer) -> None:  # type: ignore[no-untyped-def]
    closing = ClosingTokens.from_tokenizer(tokenizer, 49152)
    in_string = {tokenizer.decode([i]) for i in _ids(closing.in_string)}
    outside = {tokenizer.decode([i]) for i in _ids(closing.outside)}
    assert {'"', '"]', '"}'} <= in_string and {"]", "}", "]}", "}}"} <= outside
    assert all(t.strip().startswith('"') for t in in_string)
    assert all(set(t.strip()) <= set("]}") for t in outside)


def test_string_scanner_follows_quotes_and_escapes(tokenizer) -> None:  # type: ignore[no-untyped-def]
    closer = EarlyCloser()
    expected = [('{"a": ["wa\\"ter', True), ('", "x', True), ('"', False), (', "\\\\', True), ('"]}', False)]
    for text, inside in expected:
        for token in tokenizer.encode(text):
            closer.add(token)
        assert closer.in_string(tokenizer) is inside, text


def test_restriction_keeps_only_allowed_closing_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    closing = ClosingTokens.from_tokenizer(tokenizer, 49152)
    closer = EarlyCloser()
    for token in tokenizer.encode('["water", "water"'):
        closer.add(token)
    close_bracket, comma = tokenizer.encode("]")[0], tokenizer.encode(",")[0]
    row = _row(close_bracket, comma)
    assert closer.restrict(row, closing, tokenizer)
    assert _ids(row) == [close_bracket]  # the grammar allowed both; closing keeps "]"
    only_comma = np.zeros(1536, dtype=np.int32)
    only_comma[comma // 32] = np.int32(1 << (comma % 32))
    before = only_comma.copy()
    assert not closer.restrict(only_comma, closing, tokenizer)  # nothing closing allowed: untouched
    assert (only_comma == before).all()


def test_budget_reserve() -> None:
    assert budget_reserve(1024) == 128 and budget_reserve(40) == 10 and budget_reserve(1) == 0


def _row(*tokens: int) -> np.ndarray:
    """A bitmask row allowing ``tokens``."""
    row = np.zeros(1536, dtype=np.int32)
    for token in tokens:
        row[token // 32] |= np.int32(1 << (token % 32)) if token % 32 != 31 else np.int32(-(1 << 31))
    return row
