"""``minProperties: 1`` on an object open to names it does not list compiles and is enforced:
a repeated name cannot make an empty object look non-empty, so the refusal of counted open
objects (``interface.find_counted_open_object``) starts at ``minProperties: 2``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guidespec.grammar_backends import create_backend
from guidespec.grammar_backends.interface import find_counted_open_object
from guidespec.protocol import GuidedDecoding

OPEN_NON_EMPTY = [
    {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
    {
        "type": "object",
        "patternProperties": {"^[a-c]$": {"type": "integer"}},
        "additionalProperties": False,
        "minProperties": 1,
    },
]


def test_only_counts_past_one_are_refused() -> None:
    assert not any(find_counted_open_object(s) for s in OPEN_NON_EMPTY)
    assert all(find_counted_open_object({**s, "minProperties": 2}) for s in OPEN_NON_EMPTY)


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("schema", OPEN_NON_EMPTY, ids=["additionalProperties", "patternProperties"])
def test_an_open_object_with_min_properties_1_is_never_empty(
    real_model_dir: Path, backend_name: str, schema: dict[str, object]
) -> None:
    from transformers import AutoTokenizer

    from tests.grammar_backends.dataset import SEPARATORS, matcher_accepts

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    backend = create_backend(backend_name, tokenizer, 49152, (2,))
    compiled = backend.compile(GuidedDecoding(json_schema=json.dumps(schema)))
    key = SEPARATORS[backend_name][1]
    assert not matcher_accepts(backend, compiled, tokenizer, "{}", 2)
    assert matcher_accepts(backend, compiled, tokenizer, '{"a"' + key + "1}", 2)
    assert not matcher_accepts(backend, compiled, tokenizer, '{"a"' + key + '"x"}', 2)
