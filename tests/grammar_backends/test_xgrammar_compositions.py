"""xgrammar and the shapes the exact rewrites produce (``rewrites/``): an ``anyOf`` inside an
``allOf`` beside other keywords, and ``properties: {name: false}``.

xgrammar compiles only a composition and drops the keywords beside it; the backend moves them
into the branches, and now does so again where merging an ``allOf`` leaves an ``anyOf`` beside
them (a ``required`` there was dropped: ``{"b": 1}`` was accepted without the required "a").
xgrammar cannot compile a ``false`` schema at all; its objects hold only the names they
declare, so the backend leaves an absent name undeclared, and refuses where
``additionalProperties`` or a pattern could still produce it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from guidespec.grammar_backends import GrammarError, create_backend
from guidespec.protocol import GuidedDecoding

INTEGERS = {"a": {"type": "integer"}, "b": {"type": "integer"}}
CASES = [  # (schema, accepted texts, rejected texts)
    (
        {
            "type": "object",
            "required": ["a"],
            "properties": INTEGERS,
            "allOf": [{"anyOf": [{"required": ["b"]}, {"properties": {"x": {"type": "string"}}}]}],
        },
        ['{"a": 1}', '{"a": 1, "b": 2}'],
        ['{"b": 1}', "{}"],
    ),
    (
        {"type": "object", "properties": INTEGERS, "anyOf": [{"properties": {"b": False}}, {"required": ["b"]}]},
        ['{"a": 1}', '{"b": 1}', '{"a": 1, "b": 2}'],
        ['{"a": "x"}'],
    ),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": False}}, ['{"a": 1}', "{}"], ['{"b": 1}']),
    ({"type": "object", "properties": INTEGERS, "allOf": [{"properties": {"b": False}}]}, ['{"a": 1}'], ['{"b": 1}']),
]
REFUSED = [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": False}, "additionalProperties": True},
    {"type": "object", "properties": {"b": False}, "patternProperties": {"^b": {"type": "integer"}}},
]


@pytest.fixture(scope="module")
def backend(real_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    return create_backend("xgrammar", tokenizer, 49152, (2,)), tokenizer


@pytest.mark.parametrize("schema, accepted, rejected", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_rewritten_shapes_are_enforced(backend: Any, schema: Any, accepted: list[str], rejected: list[str]) -> None:
    from tests.grammar_backends.dataset import matcher_accepts

    xgrammar, tokenizer = backend
    compiled = xgrammar.compile(GuidedDecoding(json_schema=schema))
    assert all(matcher_accepts(xgrammar, compiled, tokenizer, text, 2) for text in accepted)
    assert not any(matcher_accepts(xgrammar, compiled, tokenizer, text, 2) for text in rejected)


@pytest.mark.parametrize("schema", REFUSED, ids=["additionalProperties", "patternProperties"])
def test_a_false_property_an_open_object_could_still_hold_is_refused(backend: Any, schema: Any) -> None:
    with pytest.raises(GrammarError, match="xgrammar cannot forbid"):
        backend[0].compile(GuidedDecoding(json_schema=schema))
