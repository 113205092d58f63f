"""xgrammar and arrays with many required (or allowed) items: the backend writes ``minItems`` /
``maxItems`` above 128 as ``prefixItems`` that name one definition (xgrammar's counted repetition
made each accept grow with the items written: 19 µs an accept past the 300th integer, against
1.1). The arrays must stay the same: each one's grammar accepts exactly the lengths and items the
schema does, as ``jsonschema`` reads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from guidespec.grammar_backends import create_backend
from guidespec.grammar_backends.xgrammar_backend import _counted_items_as_prefix
from guidespec.protocol import GuidedDecoding

INTEGER = {"type": "integer"}
CASES = [  # (schema, the lengths checked, an item's text)
    ({"type": "array", "items": INTEGER, "minItems": 300}, (0, 299, 300, 301, 340), "7"),
    ({"type": "array", "items": INTEGER, "maxItems": 200}, (0, 1, 199, 200, 201), "7"),
    ({"type": "array", "items": INTEGER, "minItems": 150, "maxItems": 300}, (149, 150, 300, 301), "7"),
    ({"type": "array", "minItems": 129}, (128, 129, 130), '"x"'),  # (no items: any value)
    ({"type": "array", "items": INTEGER, "prefixItems": [{"type": "string"}], "minItems": 140}, (139, 140, 141), "7"),
]


@pytest.fixture(scope="module")
def backend(real_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    return create_backend("xgrammar", tokenizer, 49152, (2,)), tokenizer


def _array(length: int, item: str, first: str | None = None) -> str:
    items = [item] * length
    if first is not None and items:
        items[0] = first
    return "[" + ", ".join(items) + "]"


@pytest.mark.parametrize("schema, lengths, item", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_many_items_are_enforced_as_the_schema_says(backend: Any, schema: Any, lengths: Any, item: str) -> None:
    from tests.grammar_backends.dataset import matcher_accepts

    xgrammar, tokenizer = backend
    rewritten = _counted_items_as_prefix(schema)
    assert rewritten != schema and rewritten["prefixItems"]  # (the rewrite is what this test checks)
    compiled = xgrammar.compile(GuidedDecoding(json_schema=schema))
    first = '"s"' if "prefixItems" in schema else None
    checked = 0
    for length in lengths:
        text = _array(length, item, first)
        valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        assert matcher_accepts(xgrammar, compiled, tokenizer, text, 2) == valid, (length, valid)
        checked += valid
    assert 0 < checked < len(lengths)  # (both sides of a bound were tried)
    if item == "7":  # an item the schema refuses (the others allow any)
        assert not matcher_accepts(xgrammar, compiled, tokenizer, _array(max(lengths), '"x"'), 2)


def test_a_nested_array_refers_to_its_item_definition(backend: Any) -> None:
    from tests.grammar_backends.dataset import matcher_accepts

    xgrammar, tokenizer = backend
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"$ref": "#/$defs/name"}, "minItems": 130}},
        "required": ["a"],
        "$defs": {"name": {"type": "string", "maxLength": 3}},
    }
    rewritten = _counted_items_as_prefix(schema)
    assert rewritten["properties"]["a"]["prefixItems"] == [{"$ref": "#/$defs/name"}] * 130
    assert rewritten["$defs"] == schema["$defs"]  # (a reference is used as it is)
    compiled = xgrammar.compile(GuidedDecoding(json_schema=schema))
    for length, valid in ((129, False), (130, True), (131, True)):
        assert matcher_accepts(xgrammar, compiled, tokenizer, '{"a": ' + _array(length, '"abc"') + "}", 2) == valid
    assert not matcher_accepts(xgrammar, compiled, tokenizer, '{"a": ' + _array(130, '"abcd"') + "}", 2)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array", "items": INTEGER, "minItems": 128},  # (xgrammar expands these itself)
        {"type": "array", "items": INTEGER, "minItems": 1025},  # (the compile would cost more than it saves)
        {"type": "array", "items": INTEGER, "minItems": 200, "contains": INTEGER},
        {"type": "array", "items": [INTEGER], "minItems": 200},
        {"type": "array", "items": False, "minItems": 200},
        {"type": "object", "minItems": 200},
    ],
    ids=["128", "1025", "contains", "items-list", "items-false", "not-an-array"],
)
def test_other_arrays_are_left_alone(schema: Any) -> None:
    assert _counted_items_as_prefix(schema) == schema


def test_the_item_definition_never_takes_a_name_the_schema_holds(backend: Any) -> None:
    from tests.grammar_backends.dataset import matcher_accepts

    xgrammar, tokenizer = backend
    own = {"type": "string"}  # the schema's own definition under the name the rewrite would use first
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": INTEGER, "minItems": 130},
            "b": {"$ref": "#/$defs/guidespec-item-0"},
        },
        "$defs": {"guidespec-item-0": own},
    }
    rewritten = _counted_items_as_prefix(schema)
    assert rewritten["$defs"]["guidespec-item-0"] == own and len(rewritten["$defs"]) == 2
    compiled = xgrammar.compile(GuidedDecoding(json_schema=schema))
    assert matcher_accepts(xgrammar, compiled, tokenizer, '{"a": ' + _array(130, "7") + ', "b": "x"}', 2)
    assert not matcher_accepts(xgrammar, compiled, tokenizer, '{"a": ' + _array(130, "7") + ', "b": 7}', 2)


def test_a_reference_into_items_keeps_them() -> None:
    """``maxItems`` written out sets ``items: false``: not where a ``$ref`` reads an array's items."""
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": INTEGER, "maxItems": 300},
            "b": {"$ref": "#/properties/a/items"},
        },
    }
    assert _counted_items_as_prefix(schema) == schema
