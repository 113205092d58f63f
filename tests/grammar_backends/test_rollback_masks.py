"""A mask after a rollback is the mask of the state the matcher is in: speculative decoding walks
a grammar through drafts, fills, and rolls back every step, and a sampled token is checked
against the grammar after that. llguidance 1.5.1+ keeps its last mask across a rollback; its
wrapper here refreshes it (``LLGuidanceMatcher``). Each fill is compared with a fresh matcher
that took only the tokens that stand."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from guidespec.grammar_backends import create_backend
from guidespec.bitmask import allowed_ids, bitmask_width
from guidespec.protocol import GuidedDecoding

VOCAB = 49152
ANY_OBJECT = GuidedDecoding(json_schema={"type": "object", "additionalProperties": {}})
NESTED = GuidedDecoding(
    json_schema={
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "meta": {"type": "object", "additionalProperties": {"type": "string"}},
            "score": {"type": "number"},
        },
    }
)


@pytest.fixture(scope="module")
def tokenizer(real_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


def _mask(backend: Any, matcher: Any) -> np.ndarray:
    row = np.zeros((1, bitmask_width(VOCAB)), dtype=np.int32)
    backend.fill_bitmasks([matcher], row, [0])
    return row[0]


def _matcher(backend: Any, compiled: Any, copies: bool) -> Any:
    """A matcher; ``copies=False``: an llguidance one that keeps no copy where it was filled (as
    once a copy costs more than a fill: ``LLGuidanceMatcher._before_walk``), so each rollback
    there is answered by a refresh."""
    matcher = backend.create_matcher(compiled)
    if not copies:
        matcher._copies = False
    return matcher


def _fresh_mask(backend: Any, compiled: Any, tokens: list[int]) -> np.ndarray:
    matcher = backend.create_matcher(compiled)
    for token in tokens:
        assert matcher.accept_token(token)
    return _mask(backend, matcher)


@pytest.mark.parametrize("copies", [True, False], ids=["copies", "no-copies"])
def test_a_draft_rolled_back_leaves_no_trace_in_the_next_mask(tokenizer, copies: bool) -> None:  # type: ignore[no-untyped-def]
    """The JME_60 failure in small (llguidance's compact JSON; xgrammar's has spaces and no
    such cache): the mask at ``{"k":["`` (a string in an array) was answered again at
    ``{"k":{"`` (a key), so it allowed ``","`` there, and the grammar then refused it."""
    backend = create_backend("llguidance", tokenizer, VOCAB, (2,))
    compiled = backend.compile(ANY_OBJECT)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prefix, draft, token = encode('{"k":'), encode('["'), encode('{"')
    assert len(draft) == 1 and len(token) == 1
    comma_quote = encode('","')
    assert len(comma_quote) == 1

    matcher = _matcher(backend, compiled, copies)
    for t in prefix:
        assert matcher.accept_token(t)
    _mask(backend, matcher)  # the step's mask at its state
    assert matcher.accept_token(draft[0])
    after_draft = _mask(backend, matcher)  # the draft's row
    assert comma_quote[0] in allowed_ids(after_draft, VOCAB)
    matcher.rollback(1)
    assert matcher.accept_token(token[0])  # the sampled token, not the draft
    mask = _mask(backend, matcher)
    assert comma_quote[0] not in allowed_ids(mask, VOCAB)
    np.testing.assert_array_equal(mask, _fresh_mask(backend, compiled, prefix + token))


@pytest.mark.parametrize(
    "backend_name, copies", [("xgrammar", True), ("llguidance", True), ("llguidance", False)], ids=str
)
@pytest.mark.parametrize("guided", [ANY_OBJECT, NESTED], ids=["any-object", "nested"])
def test_every_draft_then_another_token_leaves_the_mask_of_the_other(
    tokenizer,  # type: ignore[no-untyped-def]
    backend_name: str,
    copies: bool,
    guided: GuidedDecoding,
) -> None:
    """At states a walk over structural tokens reaches (where rows of the parser begin and end,
    so a stale row shows), for every pair of such tokens the state allows: fill, take the first
    as a draft, fill, roll back, take the second as the step's token, fill; that last mask is
    the one a fresh matcher that took only the second gives."""
    backend = create_backend(backend_name, tokenizer, VOCAB, (2,))
    compiled = backend.compile(guided)
    pieces = [
        '{"',
        '["',
        '":',
        '","',
        '"',
        ",",
        "[",
        "{",
        "]",
        "}",
        "1",
        "a",
        "true",
        '":"',
        '":["',
        '":{"',
        ": ",
        ", ",
        '": ',
        '", "',
        ': "',
        ', "',
        '": [',
        '": {',
    ]
    structural = sorted(
        {ids[0] for ids in (tokenizer.encode(p, add_special_tokens=False) for p in pieces) if len(ids) == 1}
    )
    rng = random.Random(45)

    def allowed_structural(tokens: list[int]) -> list[int]:
        """The structural tokens the state allows, else two it allows (a property's name)."""
        allowed = [t for t in allowed_ids(_fresh_mask(backend, compiled, tokens), VOCAB).tolist() if t != 2]
        chosen = [t for t in structural if t in set(allowed)]
        return chosen or rng.sample(allowed, min(2, len(allowed)))

    states: list[list[int]] = [[]]
    frontier: list[list[int]] = [[]]
    for _ in range(5):  # a few levels deep, a sample of each level
        children = [state + [t] for state in frontier for t in allowed_structural(state)]
        frontier = rng.sample(children, min(4, len(children)))
        states += frontier
    checked = 0
    for state in states:
        options = allowed_structural(state)
        pairs = [(draft, token) for draft in options for token in options if draft != token]
        for draft, token in pairs:
            matcher = _matcher(backend, compiled, copies)
            for t in state:
                assert matcher.accept_token(t)
            _mask(backend, matcher)
            assert matcher.accept_token(draft)
            if matcher.is_terminated():
                continue
            _mask(backend, matcher)
            matcher.rollback(1)
            assert matcher.accept_token(token)
            if matcher.is_terminated():
                continue
            np.testing.assert_array_equal(_mask(backend, matcher), _fresh_mask(backend, compiled, state + [token]))
            checked += 1
    assert checked >= 20, checked
