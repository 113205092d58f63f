"""Every exact rewrite of ``grammar_backends/rewrites.py`` accepts exactly what the schema it
rewrites accepts: checked with the jsonschema library on the dataset's valid and invalid
instances of every schema a rewrite applies to, and on instances hypothesis generates (any JSON
value, the schema's own enum values, and values near them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guidespec.grammar_backends.rewrites import rewrite_schema

DRAFT_4 = "http://json-schema.org/draft-04/schema#"
DRAFT_7 = "http://json-schema.org/draft-07/schema#"
SCHEMAS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "jsonschemabench" / "schemas"

HAND = {  # (schema, what it becomes, the rewrites applied)
    "double negation": (
        {"not": {"not": {"type": "string", "minLength": 2}}},
        {"type": "string", "minLength": 2},
        ["double negation"],
    ),
    "double negation beside keywords": (
        {"type": "string", "not": {"not": {"maxLength": 3}}},
        {"type": "string", "allOf": [{"maxLength": 3}]},
        ["double negation"],
    ),
    "an enum beside a type none of its values has: the optional property is left out": (
        {"type": "object", "properties": {"a": {"type": "string"}, "b": {"enum": ["M", "D"], "type": "object"}}},
        {"type": "object", "properties": {"a": {"type": "string"}, "b": False}},
        ["finite values"],
    ),
    "a const beside a type it does not have, in an anyOf": (
        {"anyOf": [{"type": "integer", "const": "x"}, {"type": "string", "maxLength": 3}]},
        {"anyOf": [{"type": "string", "maxLength": 3}]},
        ["finite values", "nothing matches"],
    ),
    "an enum narrowed by its type": (
        {"type": "string", "enum": ["a", 1, None]},
        {"enum": ["a"]},
        ["finite values"],
    ),
    "enum narrowed by a pattern": (
        {"enum": ["ab", "b", "abc"], "pattern": "^a"},
        {"enum": ["ab", "abc"]},
        ["finite values"],
    ),
    "allOf of an enum and a not": (
        {"allOf": [{"enum": [1, "x", None]}, {"not": {"type": "string"}}]},
        {"enum": [1, None]},
        ["not of a type", "finite values"],
    ),
    "not of a type": (
        {"type": ["string", "integer", "null"], "not": {"type": "null"}},
        {"type": ["string", "integer"]},
        ["not of a type"],
    ),
    "dependencies, both forms": (
        {"type": "object", "dependencies": {"a": ["b"], "c": {"required": ["d"]}}},
        {
            "type": "object",
            "allOf": [
                {"anyOf": [{"properties": {"a": False}}, {"required": ["a", "b"]}]},
                {"anyOf": [{"properties": {"c": False}}, {"allOf": [{"required": ["c"]}, {"required": ["d"]}]}]},
            ],
        },
        ["dependencies"],
    ),
    "dependentRequired": (
        {"dependentRequired": {"x": ["y", "z"]}},
        {"allOf": [{"anyOf": [{"properties": {"x": False}}, {"required": ["x", "y", "z"]}]}]},
        ["dependencies"],
    ),
    "not of number removes integer": (
        {"not": {"type": "number"}},
        {"type": ["null", "boolean", "object", "array", "string"]},
        ["not of a type"],
    ),
    "not of required": (
        {"type": "object", "not": {"required": ["a", "b"]}},
        {
            "type": "object",
            "anyOf": [{"type": "object", "properties": {"a": False}}, {"type": "object", "properties": {"b": False}}],
        },
        ["not"],
    ),
    "not of string values": (
        {"type": "string", "not": {"enum": ["ab", "b"]}},
        {"type": "string", "pattern": r"^(|[^ab][\s\S]*|a((|[^b][\s\S]*|b(([\s\S]+))))|b(([\s\S]+)))$"},
        ["not"],
    ),
    "not of a range": (
        {"type": "number", "not": {"minimum": 1, "maximum": 5}},
        {
            "type": "number",
            "anyOf": [{"type": "number", "exclusiveMaximum": 1}, {"type": "number", "exclusiveMinimum": 5}],
        },
        ["not"],
    ),
    "not of anyOf": (
        {"not": {"anyOf": [{"type": "string"}, {"minimum": 3}]}},
        {
            "allOf": [
                {"type": ["null", "boolean", "object", "array", "number"]},
                {"type": "number", "exclusiveMaximum": 3},
            ]
        },
        ["not"],
    ),
    "not of a character class": (
        {"type": "string", "not": {"pattern": r"^[\s.]+$"}},
        {"type": "string", "anyOf": [{"type": "string", "pattern": r"[^\s.]"}, {"type": "string", "maxLength": 0}]},
        ["not"],
    ),
    "not of a property": (
        {"type": "object", "not": {"properties": {"a": {"type": "string"}}, "required": ["a"]}},
        {
            "type": "object",
            "anyOf": [
                {
                    "type": "object",
                    "required": ["a"],
                    "properties": {"a": {"type": ["null", "boolean", "object", "array", "number"]}},
                },
                {"type": "object", "properties": {"a": False}},
            ],
        },
        ["not"],
    ),
    "not of nothing": (
        {"type": "object", "properties": {"a": {"not": {}}}},
        {"type": "object", "properties": {"a": False}},
        ["not"],
    ),
    "if/then/else": (
        {
            "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
            "then": {"required": ["b"]},
            "else": {"required": ["c"]},
        },
        {
            "anyOf": [
                {"properties": {"a": {"const": 1}}, "required": ["a", "b"]},
                {
                    "anyOf": [
                        {
                            "type": "object",
                            "required": ["a"],
                            "properties": {
                                "a": {
                                    "anyOf": [
                                        {"type": ["null", "boolean", "object", "array", "string"]},
                                        {"type": "number", "exclusiveMaximum": 1},
                                        {"type": "number", "exclusiveMinimum": 1},
                                    ]
                                }
                            },
                        },
                        {"type": "object", "properties": {"a": False}},
                    ],
                    "required": ["c"],
                },
            ]
        },
        ["if/then/else"],
    ),
    "oneOf of one branch": (
        {"type": "object", "oneOf": [{"required": ["a"]}]},
        {"type": "object", "required": ["a"]},
        ["oneOf of one branch"],
    ),
    "oneOf of disjoint branches": (
        {
            "type": "object",
            "required": ["kind"],
            "oneOf": [{"properties": {"kind": {"const": "a"}}}, {"properties": {"kind": {"const": "b"}}}],
        },
        {
            "type": "object",
            "required": ["kind"],
            "anyOf": [{"properties": {"kind": {"const": "a"}}}, {"properties": {"kind": {"const": "b"}}}],
        },
        ["oneOf of disjoint branches"],
    ),
    "oneOf of finite branches": (
        {"oneOf": [{"enum": [1, 2]}, {"$ref": "#/definitions/x"}], "definitions": {"x": {"enum": [2, 3]}}},
        {"definitions": {"x": {"enum": [2, 3]}}, "enum": [1, 3]},
        ["oneOf of finite branches"],
    ),
    "oneOf by negation": (
        {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
        {
            "type": "object",
            "anyOf": [
                {"required": ["a"], "type": "object", "properties": {"b": False}},
                {"required": ["b"], "type": "object", "properties": {"a": False}},
            ],
        },
        ["oneOf by negation"],
    ),
    "unknown format": ({"type": "string", "format": "counter"}, {"type": "string"}, ["unknown format"]),
    "annotations beside $ref": (
        {"$ref": "#/definitions/x", "alias": "y", "definitions": {"x": {"type": "string"}}},
        {"$ref": "#/definitions/x", "definitions": {"x": {"type": "string"}}},
        ["annotations beside $ref"],
    ),
    "keywords beside $ref": (
        {"$ref": "#/definitions/x", "maxLength": 3, "definitions": {"x": {"type": "string"}}},
        {"maxLength": 3, "definitions": {"x": {"type": "string"}}, "allOf": [{"$ref": "#/definitions/x"}]},
        ["keywords beside $ref"],
    ),
    "keywords beside $ref its target repeats": (
        {"$schema": DRAFT_4, "$ref": "#/definitions/x", "type": "string", "definitions": {"x": {"type": "string"}}},
        {"$schema": DRAFT_4, "$ref": "#/definitions/x", "definitions": {"x": {"type": "string"}}},
        ["keywords beside $ref its target repeats"],
    ),
    "bounded integers": (
        {"type": "integer", "minimum": 1, "exclusiveMaximum": 11, "not": {"multipleOf": 3}},
        {"enum": [1, 2, 4, 5, 7, 8, 10]},
        ["bounded integers"],
    ),
    "min/maxProperties of a closed object": (
        {
            "type": "object",
            "properties": {"a": {}, "b": {}, "c": {}},
            "required": ["a"],
            "additionalProperties": False,
            "minProperties": 2,
            "maxProperties": 2,
        },
        {
            "type": "object",
            "properties": {"a": {}, "b": {}, "c": {}},
            "required": ["a"],
            "additionalProperties": False,
            "anyOf": [{"required": ["b"]}, {"required": ["c"]}],
            "allOf": [{"anyOf": [{"properties": {"b": False}}, {"properties": {"c": False}}]}],
        },
        ["min/maxProperties of a closed object"],
    ),
    "not beside a $ref, draft 7": (
        {
            "$schema": DRAFT_7,
            "$ref": "#/definitions/x",
            "not": {"required": ["a"]},
            "definitions": {"x": {"type": "object"}},
        },
        {
            "$schema": DRAFT_7,
            "$ref": "#/definitions/x",
            "definitions": {"x": {"type": "object"}},
            "allOf": [{"type": "object", "properties": {"a": False}}],
        },
        ["not"],
    ),
    "not of propertyNames, as written": (
        {"type": "object", "not": {"propertyNames": {"not": {"enum": ["a", "b"]}}}},
        {"type": "object", "anyOf": [{"type": "object", "required": ["a"]}, {"type": "object", "required": ["b"]}]},
        ["not", "not"],
    ),  # (the inner not, rewritten on its own, is not what the outer one negates)
}
LEFT_ALONE = {  # no exact rewrite: left for the backend to refuse
    "not integer": {"not": {"type": "integer"}},
    "not of a pattern": {"type": "string", "not": {"pattern": "^a"}},
    "an enum beside its type": {"type": "string", "enum": ["a", "b"]},
    "an enum with a $ref": {"enum": ["a"], "allOf": [{"$ref": "#/definitions/x"}], "definitions": {"x": {}}},
    "an enum with a format": {"enum": ["a"], "format": "email", "minLength": 1},
    "keywords beside $ref in draft 7": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$ref": "#/definitions/x",
        "maxLength": 3,
        "definitions": {"x": {"type": "string"}},
    },
    "oneOf of overlapping strings": {"oneOf": [{"type": "string", "pattern": "^a"}, {"type": "string"}]},
    "a draft-3 format in a draft-3 schema": {
        "$schema": "http://json-schema.org/draft-03/schema#",
        "type": "string",
        "format": "host-name",
    },
    "bounded integers in draft 4": {
        "$schema": DRAFT_4,
        "type": "integer",
        "minimum": 1,
        "maximum": 3,
        "not": {"multipleOf": 2},
    },
    "not of an object value": {"not": {"const": {"a": 1}}},
    "not of a multipleOf": {"type": "number", "not": {"multipleOf": 2}},
    "if of a pattern": {"if": {"pattern": "^a"}, "then": {"maxLength": 2}},
    "bounded integers beside a $ref, draft 7": {
        "$schema": DRAFT_7,
        "$ref": "#/definitions/x",
        "type": "integer",
        "minimum": 1,
        "maximum": 3,
        "not": {"multipleOf": 2},
        "definitions": {"x": {}},
    },
    "oneOf of typed values in draft 4": {
        "$schema": DRAFT_4,
        "oneOf": [{"type": "integer", "enum": [1, 2]}, {"enum": [2, 3]}],
    },
    "minProperties of an open object": {"type": "object", "properties": {"a": {}}, "minProperties": 1},
    "not of a recursive reference": {
        "not": {"$ref": "#/definitions/t"},
        "definitions": {"t": {"properties": {"a": {"$ref": "#/definitions/t"}}, "required": ["a"]}},
    },
}


def _dataset() -> list[tuple[str, Any, list[Any]]]:
    out = []
    for path in sorted(SCHEMAS.glob("*.json")):
        data = json.loads(path.read_text())
        if rewrite_schema(data["schema"])[1]:
            out.append((path.stem, data["schema"], [t.get("data") for t in data.get("tests", [])]))
    return out


DATASET = _dataset()


def _validity(schema: Any, reference: Any, value: Any) -> bool:
    """``value`` against ``schema`` in the draft ``reference`` is written in (a schema using
    ``dependencies`` and no ``$schema`` is read as draft 7: in 2020-12 it would be ignored)."""
    default = (
        jsonschema.Draft7Validator if '"dependencies"' in json.dumps(reference) else jsonschema.Draft202012Validator
    )
    cls = jsonschema.validators.validator_for(reference, default=default)
    return bool(cls(schema).is_valid(value))


def _same(original: Any, value: Any) -> None:
    rewritten, _ = rewrite_schema(original)
    assert _validity(rewritten, original, value) == _validity(original, original, value), (original, rewritten, value)


@pytest.mark.parametrize("name", list(HAND))
def test_each_rewrite_gives_what_it_should(name: str) -> None:
    schema, expected, applied = HAND[name]
    assert rewrite_schema(schema) == (expected, applied)


@pytest.mark.parametrize("name", list(LEFT_ALONE))
def test_what_cannot_be_rewritten_exactly_is_left_alone(name: str) -> None:
    assert rewrite_schema(LEFT_ALONE[name]) == (LEFT_ALONE[name], [])


MATCH_NOTHING = {  # (schema, what the refusal says)
    "no value left": ({"enum": ["a"], "minLength": 2}, 'none of the values ["a"] fits the minLength'),
    "a required property whose enum contradicts its type": (
        {
            "type": "object",
            "properties": {"builtin": {"enum": ["MODIFIABLE", "DELETABLE", "IMMUTABLE"], "type": "object"}},
            "required": ["builtin"],
        },
        "required property 'builtin' can have no value",
    ),
    "an allOf with a branch of no value": (
        {"allOf": [{"type": "string"}, {"const": 3, "type": "string"}]},
        "a branch of an allOf matches nothing",
    ),
    "an array that needs an item of no value": (
        {"type": "array", "items": {"enum": [1], "type": "string"}, "minItems": 1},
        "items matches nothing",
    ),
}


@pytest.mark.parametrize("name", sorted(MATCH_NOTHING))
def test_a_schema_no_value_matches_is_refused_with_the_reason(name: str) -> None:
    from guidespec.grammar_backends import GrammarError
    from guidespec.grammar_backends.interface import is_refusal

    schema, reason = MATCH_NOTHING[name]
    with pytest.raises(GrammarError) as raised:
        rewrite_schema(schema)
    assert str(raised.value).startswith("no JSON value can match this json_schema") and reason in str(raised.value)
    assert not is_refusal(str(raised.value))  # (no other backend is tried: the schema is at fault)


@pytest.mark.skipif(not SCHEMAS.exists(), reason="the shared data set is not beside this checkout")
def test_the_dataset_has_schemas_to_rewrite() -> None:
    applied = [set(rewrite_schema(schema)[1]) for _, schema, _ in DATASET]
    assert len(DATASET) >= 20 and all(
        any(name in a for a in applied)
        for name in (
            "double negation",
            "finite values",
            "not of a type",
            "dependencies",
            "not",
            "if/then/else",
            "oneOf of one branch",
            "oneOf of disjoint branches",
            "oneOf of finite branches",
            "oneOf by negation",
            "unknown format",
            "annotations beside $ref",
            "keywords beside $ref its target repeats",
        )
    )


@pytest.mark.parametrize("name, schema, instances", DATASET, ids=[d[0][:60] for d in DATASET])
def test_dataset_instances_are_judged_alike(name: str, schema: Any, instances: list[Any]) -> None:
    for value in instances:
        _same(schema, value)


def _values_in(node: Any) -> list[Any]:
    """Every enum and const value in a schema (the values a rewrite keeps or drops)."""
    found: list[Any] = []
    if isinstance(node, dict):
        found += node.get("enum", []) if isinstance(node.get("enum"), list) else []
        found += [node["const"]] if "const" in node else []
        for v in node.values():
            found += _values_in(v)
    elif isinstance(node, list):
        for v in node:
            found += _values_in(v)
    return found


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.floats(-10, 10, allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
_CASES = [s for s, _, _ in HAND.values()] + [s for _, s, _ in DATASET]


def _names_in(node: Any) -> list[str]:
    """Property names a schema mentions (its properties, required and dependencies' names)."""
    names: list[str] = []
    if isinstance(node, dict):
        for key in ("properties", "dependencies", "dependentRequired", "dependentSchemas"):
            if isinstance(node.get(key), dict):
                names += list(node[key])
        for key in ("required",):
            names += [n for n in node.get(key, []) if isinstance(n, str)] if isinstance(node.get(key), list) else []
        for v in node.values():
            names += _names_in(v)
        for deps in (node.get("dependencies"), node.get("dependentRequired")):
            if isinstance(deps, dict):
                names += [n for need in deps.values() if isinstance(need, list) for n in need if isinstance(n, str)]
    elif isinstance(node, list):
        for v in node:
            names += _names_in(v)
    return sorted(set(names))


def _objects(names: list[str]) -> st.SearchStrategy[Any]:
    """Objects whose keys are mostly the schema's own names (where dependencies bite)."""
    keys = st.sampled_from(names) | st.text(max_size=2) if names else st.text(max_size=2)
    return st.dictionaries(keys, _JSON, max_size=4)


@settings(max_examples=400, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_generated_instances_are_judged_alike(data: st.DataObject) -> None:
    schema = data.draw(st.sampled_from(_CASES))
    known = _values_in(schema)
    generated = _JSON | _objects(_names_in(schema))
    value = data.draw(generated | st.sampled_from(known) if known else generated)
    if known and data.draw(st.booleans()):  # a near miss: a known value inside a list or an object
        value = data.draw(st.sampled_from([[value], {"foo": value}, {"bar": value, "foo": 1}]))
    _same(schema, value)


@pytest.mark.parametrize("name", list(HAND))
def test_a_disabled_rewrite_is_not_applied(name: str) -> None:
    """``rewrite_schema(schema, disabled)``, which ``benchmarks/coverage.py --by-rewrite`` uses to
    count what each rewrite unlocks, applies none of the disabled ones."""
    from guidespec.grammar_backends.rewrites import REWRITES

    schema, _, applied = HAND[name]
    assert set(applied) <= set(REWRITES)
    assert rewrite_schema(schema, frozenset(REWRITES)) == (schema, [])
    assert not set(applied) & set(rewrite_schema(schema, frozenset(applied))[1])
