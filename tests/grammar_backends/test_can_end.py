"""``GrammarMatcher.can_end`` (the scheduler's end check: ``GrammarManager.end_tokens``) answers as
a trial accept of the stop token would, on both backends: regexes, choices and JSON schemas walked
by random allowed tokens, the stop token among them now and then (a stopped matcher takes nothing)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from guidespec.bitmask import allowed_ids, bitmask_width
from guidespec.grammar_backends import create_backend
from guidespec.protocol import GuidedDecoding

VOCAB, STOP = 49152, 2
GRAMMARS = [
    GuidedDecoding(regex="[0-9a-z ]+"),
    GuidedDecoding(regex=r"\d{3}-\d{4}"),
    GuidedDecoding(regex="aa|a[ab]x+"),
    GuidedDecoding(choice=["yes", "no", "not sure"]),
    GuidedDecoding(json_schema={"type": "array", "items": {"type": "integer"}, "minItems": 3}),
    GuidedDecoding(json_schema={"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array"}}}),
]


@pytest.fixture(scope="module")
def tokenizer(real_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


def _takes(matcher: Any, token: int) -> bool:
    """A trial accept of the stop token; the matcher's end follows it there and back (xgrammar's
    is kept until the grammar moves: ``XGrammarMatcher.is_terminated``)."""
    ended = matcher.is_terminated()
    if not matcher.accept_token(token):
        assert matcher.is_terminated() == ended
        return False
    assert matcher.is_terminated()
    matcher.rollback(1)
    assert not matcher.is_terminated()
    return True


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_can_end_is_a_trial_accept_of_the_stop_token(tokenizer: Any, name: str) -> None:
    backend = create_backend(name, tokenizer, VOCAB, (STOP,), 1)
    rng = random.Random(0)
    row = np.zeros((1, bitmask_width(VOCAB)), dtype=np.int32)
    ends = states = 0
    for guided in GRAMMARS:
        compiled = backend.compile(guided)
        for _ in range(12):
            matcher = backend.create_matcher(compiled)
            for _ in range(20):
                can_end = matcher.can_end(STOP)
                assert can_end == _takes(matcher, STOP), guided
                states, ends = states + 1, ends + can_end
                if matcher.is_terminated():
                    break
                backend.fill_bitmasks([matcher], row, [0])
                allowed = allowed_ids(row[0], VOCAB)
                if STOP in allowed and rng.random() < 0.15:
                    token = STOP  # (then a stopped matcher: it can end no more)
                else:
                    allowed = allowed[allowed != STOP]
                    if not len(allowed):
                        break
                    token = int(rng.choice(allowed))
                assert matcher.accept_token(token)
    assert 0 < ends < states
