"""xgrammar's state keys (``XGrammarMatcher.state_key``): two matchers of one grammar with equal
keys have equal masks, so the scheduler fills one row of a key and copies it to the others
(``GrammarManager._fill_rows``). Checked on random regexes and choices, walked by random allowed
tokens, against each matcher's own fill."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guidespec.bitmask import allowed_ids, bitmask_width
from guidespec.grammar_backends import create_backend, xgrammar_backend
from guidespec.grammar_backends.xgrammar_backend import _MAX_PENDING, _ROW_CHECK_EVERY, _ROW_CHECKS, _UNKNOWN
from guidespec.protocol import GuidedDecoding

VOCAB = 49152


@pytest.fixture(scope="module")
def backend(real_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return create_backend("xgrammar", AutoTokenizer.from_pretrained(real_model_dir), VOCAB, (2,), 1)


def _mask(backend: Any, matcher: Any, fresh: bool = True) -> np.ndarray:
    """The matcher's mask: its own fill (``fresh``), else as a step's fill gives it (a row kept
    for its state where there is one)."""
    row = np.zeros((1, bitmask_width(VOCAB)), dtype=np.int32)
    backend.fill_bitmasks([matcher], row, [0], fresh)
    return row[0]


def _walk_keys(backend: Any, guided: GuidedDecoding, walks: int, steps: int, seed: int) -> tuple[int, int]:
    """Random walks through ``guided``'s grammar; asserts that equal keys had equal masks.
    Returns (states with a key, distinct keys)."""
    compiled = backend.compile(guided)
    rng = random.Random(seed)
    seen: dict[Any, np.ndarray] = {}
    keyed = 0
    for _ in range(walks):
        matcher = backend.create_matcher(compiled)
        for _ in range(steps):
            if matcher.is_terminated():
                break
            mask = _mask(backend, matcher)
            key = matcher.state_key()
            if key is not None:
                keyed += 1
                first = seen.setdefault(key, mask)
                assert np.array_equal(first, mask), f"{guided}: one key, two masks"
            allowed = allowed_ids(mask, VOCAB)
            assert matcher.accept_token(int(rng.choice(allowed)))
    return keyed, len(seen)


REGEXES = [
    r"[0-9a-z ]+",
    r"\d{3}-\d{4}",
    r"aa|a[ab]x+",  # after "aa" the input is a match, after "ab" not: one state, two masks
    r"(\+1 )?\(\d{3}\) \d{3}-\d{4}",
    r"(ab|a)(bc|c)?d*",
    r"\w+",
    r"(cat|dog|bird)s?( and (cat|dog|bird)s?)*",
    r"ab(x+)c|cd(x+)e",  # a rule begun after the first step returns to parents that differ
]


@pytest.mark.parametrize("regex", REGEXES)
def test_equal_keys_have_equal_masks(backend: Any, regex: str) -> None:
    keyed, distinct = _walk_keys(backend, GuidedDecoding(regex=regex), walks=40, steps=10, seed=0)
    assert keyed and distinct  # (every regex here has keyed states: the start at least)


def test_a_loop_shares_one_key_and_a_match_is_part_of_it(backend: Any) -> None:
    compiled = backend.compile(GuidedDecoding(regex="[a-z]+"))
    before, after, later = (backend.create_matcher(compiled) for _ in range(3))
    a, b = backend._encode("a")[0], backend._encode("b")[0]
    assert after.accept_token(a) and later.accept_token(b) and later.accept_token(a)
    assert after.state_key() == later.state_key() is not None
    assert before.state_key() != after.state_key()  # the stop token is allowed after a letter only
    other = backend.create_matcher(backend.compile(GuidedDecoding(regex="[a-z]+")))
    other.accept_token(a)
    assert other.state_key() != after.state_key()  # another compiled grammar: never one key


def test_choices_share_keys_exactly(backend: Any) -> None:
    keyed, distinct = _walk_keys(
        backend, GuidedDecoding(choice=["yes", "no", "not sure", "not now"]), walks=30, steps=6, seed=1
    )
    assert keyed >= 30 and distinct >= 2


_ATOMS = st.sampled_from(["a", "b", "ab", "[a-c]", "[0-9]", r"\d", "x", " ", "[a-z]", "-"])


@st.composite
def _regexes(draw: st.DrawFn, depth: int = 2) -> str:
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        if depth and draw(st.booleans()):
            inner = "|".join(draw(st.lists(_regexes(depth=depth - 1), min_size=1, max_size=3)))
            atom = f"({inner})"
        else:
            atom = draw(_ATOMS)
        parts.append(atom + draw(st.sampled_from(["", "", "*", "+", "?", "{2}", "{1,3}"])))
    return "".join(parts)


@settings(max_examples=25, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(regex=_regexes(), seed=st.integers(0, 1000))
def test_random_regexes_equal_keys_have_equal_masks(backend: Any, regex: str, seed: int) -> None:
    _walk_keys(backend, GuidedDecoding(regex=regex), walks=12, steps=8, seed=seed)


def _fresh_key(backend: Any, compiled: Any, tokens: list[int]) -> Any:
    """The key of the state ``tokens`` lead to, read from the debug text (no move known)."""
    matcher = backend.create_matcher(compiled)
    assert matcher.advance(tokens) == len(tokens)  # (a walk of its own: it learns no move)
    return matcher.state_key()


@settings(max_examples=20, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(regex=_regexes() | st.sampled_from(REGEXES), seed=st.integers(0, 1000))
def test_a_key_known_from_a_move_is_the_states_own(backend: Any, regex: str, seed: int) -> None:
    """The grammar's matchers share the moves between keyed states they have seen: a matcher that
    moves by one knows its next key without the debug text, and a rollback gives back the key it
    had there. Each such key must be the one the state's own debug text gives."""
    compiled = backend.compile(GuidedDecoding(regex=regex))
    rng = random.Random(seed)
    walks = []
    for _ in range(6):  # (the first walks teach the moves, the later ones use them)
        matcher, tokens = backend.create_matcher(compiled), []
        walks.append(tokens)
        for _ in range(8):
            if matcher.is_terminated():
                break
            assert matcher.state_key() == _fresh_key(backend, compiled, tokens), (regex, tokens)
            if rng.random() < 0.3:  # asked for its forced tokens: it stands where it stood
                matcher.forced_tokens(rng.randint(1, 3))
                assert matcher.state_key() == _fresh_key(backend, compiled, tokens), (regex, tokens)
            token = int(rng.choice(allowed_ids(_mask(backend, matcher), VOCAB)))
            assert matcher.accept_token(token)
            tokens.append(token)
            if len(tokens) > 1 and rng.random() < 0.3:  # back a step or two: the keys it had there
                back = rng.randint(1, min(2, len(tokens)))
                matcher.rollback(back)
                del tokens[-back:]
    # each walk again: where the table holds the move it makes, its next key is known from it
    # (not from the debug text) and is the state's own
    moves, known = compiled._guidespec_moves, 0
    for tokens in walks:
        matcher = backend.create_matcher(compiled)
        for i, token in enumerate(tokens):
            key = matcher.state_key()
            assert matcher.accept_token(token)
            if key is not None and (key, token) in moves:
                assert matcher._key is not _UNKNOWN, (regex, tokens[: i + 1])
                assert matcher.state_key() == _fresh_key(backend, compiled, tokens[: i + 1]), (regex, tokens)
                known += 1
    # (a walk that ends at its first token, a regex of one token, records no move to use again)
    assert known or not any(len(tokens) > 1 for tokens in walks)


def test_forced_tokens_leave_the_key_and_the_end_as_they_were(backend: Any) -> None:
    """Asking for the forced tokens accepts and rolls them back: the key and the end the matcher
    knew stay its state's (it once restored the key of an earlier accept: the fill then shared a
    row of another state with it)."""
    compiled = backend.compile(GuidedDecoding(regex=r"(x|y)(x|y)@example\.com[a-z]+"))
    matcher, tokens = backend.create_matcher(compiled), []
    for token in backend._encode("xy@"):
        matcher.state_key()  # (keys known from here on: a rollback would give one back)
        assert matcher.accept_token(token)
        tokens.append(token)
    assert not matcher.is_terminated()
    assert matcher.forced_tokens(1)  # ("example")
    assert matcher.state_key() == _fresh_key(backend, compiled, tokens)
    assert not matcher.is_terminated() and not matcher.can_end(2)


@settings(max_examples=20, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(regex=_regexes() | st.sampled_from(REGEXES), seed=st.integers(0, 1000))
def test_tokens_taken_by_known_moves_reach_xgrammar_when_read(backend: Any, regex: str, seed: int) -> None:
    """A matcher whose accepts follow known moves leaves them waiting (``_pending``) until it is
    read: its masks, ends, forced tokens and rollbacks (across waiting tokens and taken ones) stay
    those of a matcher that never asks for keys, step by step."""
    compiled = backend.compile(GuidedDecoding(regex=regex))
    rng = random.Random(seed)
    for _ in range(6):  # (the first walks teach the moves, the later ones wait on them)
        lazy, plain, tokens = backend.create_matcher(compiled), backend.create_matcher(compiled), []
        for _ in range(10):
            lazy.state_key()  # (the fill's question: it keys the state)
            assert lazy.is_terminated() == plain.is_terminated()
            assert lazy.can_end(2) == plain.can_end(2)
            if plain.is_terminated():
                break
            if rng.random() < 0.3:
                limit = rng.randint(1, 4)
                assert lazy.forced_tokens(limit) == plain.forced_tokens(limit)
            mask = _mask(backend, plain)
            if rng.random() < 0.5:  # (a row another row's fill stood for: not read this step)
                assert np.array_equal(_mask(backend, lazy), mask), (regex, tokens)
            token = int(rng.choice(allowed_ids(mask, VOCAB)))
            assert lazy.accept_token(token) and plain.accept_token(token)
            tokens.append(token)
            # a refused token: both refuse it, and stand where they stood
            if rng.random() < 0.25 and not plain.is_terminated():
                refused = allowed_ids(np.bitwise_not(_mask(backend, plain)), VOCAB)
                if len(refused):
                    bad = int(rng.choice(refused))
                    assert not lazy.accept_token(bad) and not plain.accept_token(bad)
            if len(tokens) > 1 and rng.random() < 0.3:
                back = rng.randint(1, min(3, len(tokens)))
                lazy.rollback(back)
                plain.rollback(back)
                del tokens[-back:]
        if not plain.is_terminated():
            assert np.array_equal(_mask(backend, lazy), _mask(backend, plain)), (regex, tokens)


def test_a_loops_rows_share_its_moves_and_wait(backend: Any) -> None:
    """``[0-9a-z ]+``: once one matcher has walked a token, the others take it without xgrammar;
    a fill reads the tokens first."""
    compiled = backend.compile(GuidedDecoding(regex="[0-9a-z ]+"))
    a, b = backend._encode("a")[0], backend._encode("b")[0]
    teacher, learner = backend.create_matcher(compiled), backend.create_matcher(compiled)
    for matcher in (teacher, learner):
        for token in (a, b, a, b):
            matcher.state_key()
            assert matcher.accept_token(token)
    assert list(learner._pending) == [a, b, a, b][-len(learner._pending) :] and len(learner._pending) >= 2
    mask = _mask(backend, learner)
    assert not learner._pending and np.array_equal(mask, _mask(backend, teacher))


@pytest.mark.parametrize("regex", REGEXES)
def test_a_states_kept_row_is_the_matchers_own_fill(backend: Any, regex: str) -> None:
    """A step's fill of a matcher in a keyed state whose row a fill gave before takes that row
    without xgrammar (past the first checks); each equals the matcher's own fill."""
    compiled = backend.compile(GuidedDecoding(regex=regex))
    rng = random.Random(0)
    served = 0
    for _ in range(40):
        matcher = backend.create_matcher(compiled)
        for _ in range(10):
            if matcher.is_terminated():
                break
            matcher.state_key()  # (the manager's question before a fill)
            served += matcher.kept_row() is not None
            mask = _mask(backend, matcher, fresh=False)
            assert np.array_equal(mask, _mask(backend, matcher)), regex
            assert matcher.accept_token(int(rng.choice(allowed_ids(mask, VOCAB))))
    assert served > _ROW_CHECKS  # (rows served unchecked too)


def test_a_kept_row_that_differs_from_the_fill_is_caught(backend: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A kept row that is not the state's mask (a key that lied) is found at a check: the row
    written is the matcher's own fill, and the grammar keeps no rows from then on."""
    compiled = backend.compile(GuidedDecoding(regex="[b-y]+"))  # (its own: the test turns its kept rows off)
    matcher = backend.create_matcher(compiled)
    assert matcher.accept_token(backend._encode("b")[0])
    key = matcher.state_key()
    assert key is not None
    own = _mask(backend, matcher)
    _mask(backend, matcher, fresh=False)  # (kept)
    assert matcher.kept_row() is not None
    matcher._rows[key] = np.zeros_like(own)  # a wrong row for the state
    matcher._rows["uses"] = _ROW_CHECK_EVERY  # (the next use is checked)
    assert np.array_equal(_mask(backend, matcher, fresh=False), own)
    assert "kept mask row differs" in caplog.text
    assert matcher.kept_row() is None
    _mask(backend, matcher, fresh=False)
    assert matcher.kept_row() is None, "no row kept again"


def test_waiting_tokens_are_taken_past_a_bound(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows kept for a loop's state serve its fills for a whole output: the tokens a matcher
    lets wait stay within ``_MAX_PENDING`` (past it, each accept has xgrammar take the oldest, so
    none is ever taken all at once), and it stands where a plain matcher does. (The kept rows'
    checks, whose fills read xgrammar's matcher, are put off past the test.)"""
    monkeypatch.setattr(xgrammar_backend, "_ROW_CHECK_EVERY", 1 << 30)
    compiled = backend.compile(GuidedDecoding(regex="[0-9a-z ]+"))
    a, b = backend._encode("a")[0], backend._encode("b")[0]
    lazy, plain = backend.create_matcher(compiled), backend.create_matcher(compiled)
    waiting = []
    for i in range(3 * _MAX_PENDING):
        lazy.state_key()
        _mask(backend, lazy, fresh=False)
        token = (a, b)[i % 2]
        assert lazy.accept_token(token) and plain.accept_token(token)
        waiting.append(len(lazy._pending))
    assert max(waiting) == _MAX_PENDING and waiting == sorted(waiting)  # (never taken all at once)
    assert list(lazy._pending) == [(a, b)[i % 2] for i in range(2 * _MAX_PENDING, 3 * _MAX_PENDING)]
    assert np.array_equal(_mask(backend, lazy), _mask(backend, plain))
