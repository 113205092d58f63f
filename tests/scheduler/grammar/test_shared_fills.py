"""Rows whose grammars stand in one state share one fill (``GrammarManager._fill_rows``): a batch
of regex and choice requests (and JSON ones, never keyed) gets the rows each matcher's own fill
gives, drafts' rows included; a key that lies is caught by the check of a copied row, and the
manager then fills every row itself."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from guidespec.bitmask import allowed_ids
from guidespec.protocol import GuidedDecoding
from guidespec.scheduler.grammar import FillRow, GrammarManager, GrammarSettings

VOCAB = 49152
REGEX = GuidedDecoding(regex=r"[0-9a-z ]+")
PHONE = GuidedDecoding(regex=r"\(\d{3}\) \d{3}-\d{4}")
CHOICE = GuidedDecoding(choice=["yes", "no", "not sure"])
JSON = GuidedDecoding(json_schema={"type": "array", "items": {"type": "integer"}}, close_early=False)


@pytest.fixture(scope="module")
def grammar(real_model_dir: Path) -> Iterator[GrammarManager]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    settings = GrammarSettings(real_model_dir, "xgrammar", VOCAB, (2,), compile_timeout_s=60.0, max_rows=8)
    manager = GrammarManager(settings, tokenizer)
    yield manager
    manager.shutdown()


def _start(grammar: GrammarManager, request_id: str, guided: GuidedDecoding) -> None:
    if not grammar.submit(request_id, guided):
        deadline = time.monotonic() + 60
        while request_id not in grammar.poll()[0]:
            assert time.monotonic() < deadline, "the grammar did not compile"
            time.sleep(0.01)


def _own_rows(grammar: GrammarManager, rows: list[FillRow]) -> np.ndarray:
    grammar.share_states = False
    try:
        return grammar.fill(rows).copy()
    finally:
        grammar.share_states = True


def _batch(grammar: GrammarManager, seed: int) -> list[str]:
    """Requests of four grammars, each walked a random number of random allowed tokens."""
    rng = random.Random(seed)
    ids = []
    for i, guided in enumerate([REGEX] * 6 + [PHONE] * 4 + [CHOICE] * 3 + [JSON] * 2):
        request_id = f"s{seed}-{i}"
        _start(grammar, request_id, guided)
        for _ in range(rng.randrange(4)):
            allowed = allowed_ids(grammar.fill([FillRow(request_id)])[0], VOCAB)
            allowed = allowed[allowed != 2]  # (no stop token: the grammar goes on)
            if not len(allowed):
                break
            assert grammar.accept(request_id, int(rng.choice(allowed)))
        ids.append(request_id)
    return ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shared_rows_equal_each_matchers_own_fill(grammar: GrammarManager, seed: int) -> None:
    ids = _batch(grammar, seed)
    rows = [FillRow(request_id) for request_id in ids]
    before = grammar._shared_fills
    shared = grammar.fill(rows).copy()
    assert grammar._shared_fills == before + 1  # six rows of one regex: some share a state
    assert np.array_equal(shared, _own_rows(grammar, rows))
    assert grammar.share_states
    for request_id in ids:
        grammar.release(request_id)


def test_drafts_rows_share_and_equal_their_own_fills(grammar: GrammarManager) -> None:
    ids = [f"d{i}" for i in range(4)]
    for request_id in ids:
        _start(grammar, request_id, REGEX)
    digits = [int(allowed_ids(grammar.fill([FillRow(ids[0])])[0], VOCAB)[20])] * 3
    rows = [FillRow(request_id, digits[: 1 + i % 3]) for i, request_id in enumerate(ids)]
    assert np.array_equal(grammar.fill(rows).copy(), _own_rows(grammar, rows))
    for request_id in ids:
        grammar.release(request_id)


class _LyingMatcher:
    """A real matcher whose state key is another grammar state's: the copy it gets is wrong."""

    def __init__(self, matcher: Any, key: Any) -> None:
        self._matcher, self._key = matcher, key

    def __getattr__(self, name: str) -> Any:
        return getattr(self._matcher, name)

    def state_key(self) -> Any:
        return self._key


def test_a_lying_key_is_caught_and_sharing_stops(grammar: GrammarManager) -> None:
    ids = ["l0", "l1"]
    for request_id in ids:
        _start(grammar, request_id, PHONE)
    allowed = allowed_ids(grammar.fill([FillRow("l1")])[0], VOCAB)
    assert grammar.accept("l1", int(allowed[0]))  # "(": l1 now wants a digit, l0 still "("
    backend, matcher = grammar.matchers["l1"]
    grammar.matchers["l1"] = (backend, _LyingMatcher(matcher, grammar.matchers["l0"][1].state_key()))
    grammar._shared_fills = 0  # (a check at this fill)
    rows = [FillRow(request_id) for request_id in ids]
    try:
        filled = grammar.fill(rows).copy()
        assert not grammar.share_states
        grammar.matchers["l1"] = (backend, matcher)
        assert np.array_equal(filled, _own_rows(grammar, rows))
        assert not np.array_equal(filled[0], filled[1])
    finally:
        grammar.share_states = True
        for request_id in ids:
            grammar.release(request_id)


def test_end_checks_share_answers(grammar: GrammarManager) -> None:
    """Requests complete in one state end together; "no" (which "not" goes on from) and a pattern
    that may go on end none."""
    encode = grammar.tokenizer.encode
    walks = {"e0": "yes", "e1": "yes", "e2": "yes", "e3": "no", "e4": "n", "e5": "abc", "e6": "ab"}
    for request_id, text in walks.items():
        _start(grammar, request_id, GuidedDecoding(choice=["yes", "no", "not"]) if request_id < "e5" else REGEX)
        for token in encode(text, add_special_tokens=False):
            assert grammar.accept(request_id, token)
    ids = list(walks)
    try:
        shared = grammar.end_tokens(ids)
        grammar._filled.clear()
        grammar.share_states = False
        assert grammar.end_tokens(ids) == shared
        assert sorted(shared) == ["e0", "e1", "e2"] and set(shared.values()) == {2}
    finally:
        grammar.share_states = True
        grammar._filled.clear()
        for request_id in ids:
            grammar.release(request_id)


def test_a_batch_walked_step_by_step_keeps_its_own_rows(grammar: GrammarManager) -> None:
    """Regex and choice rows advanced a token a step (most by moves the grammar knows, whose tokens
    wait: ``XGrammarMatcher.synced``), with drafts filled and rolled back and end checks between:
    each step's shared rows are each matcher's own fill."""
    rng = random.Random(7)
    ids = [f"w{i}" for i in range(8)]
    for i, request_id in enumerate(ids):
        _start(grammar, request_id, REGEX if i < 6 else CHOICE)
    waited = 0
    try:
        for step in range(15):
            live = [r for r in ids if not grammar.is_terminated(r)]
            rows = [FillRow(r) for r in live]
            shared = grammar.fill(rows).copy()
            if step % 3 == 2:  # (an own fill reads every matcher: tokens wait two steps between)
                assert np.array_equal(shared, _own_rows(grammar, rows))
            picks = []
            for request_id, row in zip(live, shared):
                allowed = allowed_ids(row, VOCAB)
                allowed = allowed[allowed != 2]
                picks.append(int(rng.choice(allowed[:40])) if len(allowed) else 2)
            drafted = [FillRow(r, [t]) for r, t in zip(live, picks) if t != 2]  # a draft each, rolled back
            filled = grammar.fill(drafted).copy()
            if step % 3 == 2:
                assert np.array_equal(filled, _own_rows(grammar, drafted))
            asks = [(r, t, 1 << 20, 1) for r, t in zip(live, picks)]
            assert all(answer[0] for answer in grammar.advance_rows(asks))  # type: ignore[index]
            grammar.end_tokens(live, picks)
            waited += sum(len(getattr(grammar.matchers[r][1], "_pending", ())) > 1 for r in live)
        assert waited, "no token waited: the rows' moves were never known"
    finally:
        for request_id in ids:
            grammar.release(request_id)
