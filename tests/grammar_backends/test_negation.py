"""``negation.negate`` accepts exactly what its schema rejects, and ``disjoint.disjoint`` only
proves what holds: checked with the jsonschema library on JSON values hypothesis generates from
the numbers, strings and property names these schemas use. (hypothesis-jsonschema 0.23.1, which
would draw instances from a schema, does not run with hypothesis 6.170: 'many' object has no
attribute 'more'.)"""

from __future__ import annotations

import itertools
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guidespec.grammar_backends.disjoint import disjoint
from guidespec.grammar_backends.negation import negate, other_strings

DEFINITIONS = {"s": {"type": "string", "minLength": 2}, "o": {"properties": {"a": {"$ref": "#/definitions/s"}}}}
NEGATABLE = [  # a schema for each keyword negate handles, and some of their combinations
    {},
    True,
    False,
    {"type": "string"},
    {"type": ["integer", "number", "null"]},
    {"const": 1},
    {"const": "ab"},
    {"enum": [True, None, 1.5, -2, "", "a", "ab", "b]"]},
    {"enum": [False]},
    {"required": ["a", "b"]},
    {"properties": {"a": {"type": "number", "minimum": 0}, "b": True}},
    {"minimum": 1},
    {"exclusiveMinimum": 1},
    {"maximum": -1.5},
    {"exclusiveMaximum": 0},
    {"minLength": 2, "maxLength": 3},
    {"minLength": 0},
    {"minItems": 1, "maxItems": 2},
    {"minProperties": 1, "maxProperties": 1},
    {"pattern": r"^[\s.,]+$"},
    {"pattern": r"^[\s-]*$"},
    {"contains": {"type": "null"}},
    {"not": {"type": "boolean"}},
    {"anyOf": [{"type": "string"}, {"minimum": 3}]},
    {"allOf": [{"required": ["a"]}, {"maxProperties": 2}]},
    {"$ref": "#/definitions/o"},
    {"type": "object", "required": ["a"], "properties": {"a": {"enum": ["x", 2]}}, "additionalProperties": True},
    {"if": True, "title": "no then"},
    {"propertyNames": False},
    {"propertyNames": {"not": {"enum": ["a", "b", 1]}}},
    {"propertyNames": True},
]
NOT_NEGATABLE = [
    {"pattern": "^a"},
    {"multipleOf": 2},
    {"format": "email"},
    {"uniqueItems": True},
    {"additionalProperties": False},
    {"const": [1]},
    {"type": "integer"},
    {"exclusiveMinimum": True},
    {"pattern": r"^[ab]+$"},
    {"propertyNames": {"enum": ["a"]}},
    {"$ref": "#/definitions/s", "maxLength": 3},
    {"oneOf": [{}, {}]},
    {"if": {"minimum": 1}, "then": {"maximum": 2}},
    {"items": {"type": "string"}},
]


def _resolve(ref: str) -> Any:
    return DEFINITIONS.get(ref.rsplit("/", 1)[-1])


def _valid(schema: Any, value: Any) -> bool:
    return bool(jsonschema.Draft202012Validator({"definitions": DEFINITIONS, "allOf": [schema]}).is_valid(value))


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-4, 4)
    | st.sampled_from([1.5, -1.5, 0.5, 2.0, 1e9])
    | st.text(alphabet="ab] .,-\n", max_size=4)
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3),
    max_leaves=6,
)


@pytest.mark.parametrize("schema", NEGATABLE, ids=[str(s)[:50] for s in NEGATABLE])
@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=_JSON)
def test_a_negation_accepts_exactly_what_its_schema_rejects(schema: Any, value: Any) -> None:
    negated = negate(schema, _resolve)
    assert negated is not None
    assert _valid(negated, value) == (not _valid(schema, value)), (schema, negated, value)


def test_in_draft_4_no_bound_is_negated() -> None:
    """There ``exclusiveMinimum`` is a flag beside ``minimum``: a number there means nothing."""
    assert negate({"minimum": 1}, _resolve, draft_4=True) is None
    assert negate({"enum": ["a", 1]}, _resolve, draft_4=True) is None
    assert negate({"enum": ["a"]}, _resolve, draft_4=True) is not None


@pytest.mark.parametrize("schema", NOT_NEGATABLE, ids=[str(s)[:50] for s in NOT_NEGATABLE])
def test_what_has_no_exact_negation_is_not_negated(schema: Any) -> None:
    assert negate(schema, _resolve) is None


def test_other_strings_matches_exactly_the_strings_not_listed() -> None:
    alphabet = "ab]^-\\"
    every = ["".join(p) for n in range(4) for p in itertools.product(alphabet, repeat=n)]
    for listed in (["ab"], ["", "a", "a]", "^-"], ["\\", "b\\a", "ba"], ["abc"] + every[:5]):
        regex = re.compile(other_strings(listed))
        for s in every + ["a\n", "abc"]:
            assert (regex.fullmatch(s) is None) == (s in listed), (listed, s)


PAIRS = [  # (a, b, the types beside them, required names beside them, proven disjoint)
    ({"type": "string"}, {"type": "integer"}, None, [], True),
    ({"type": "number"}, {"type": "integer"}, None, [], False),
    ({"enum": [1, 2]}, {"enum": [2.0, 3]}, None, [], False),
    ({"enum": [1, 2]}, {"minimum": 3}, None, [], True),
    ({"required": ["a"]}, {"required": ["b"]}, {"object"}, [], False),
    ({"required": ["a"]}, {"properties": {"a": False}}, {"object"}, [], True),
    ({"required": ["a"]}, {"properties": {"a": False}}, None, [], False),
    ({"required": ["a"]}, {"additionalProperties": False, "patternProperties": {"^b": {}}}, {"object"}, [], True),
    ({"required": ["a"]}, {"additionalProperties": False, "patternProperties": {"a": {}}}, {"object"}, [], False),
    ({"properties": {"k": {"const": "x"}}}, {"properties": {"k": {"const": "y"}}}, {"object"}, ["k"], True),
    ({"properties": {"k": {"const": "x"}}}, {"properties": {"k": {"const": "y"}}}, {"object"}, [], False),
    ({"type": "number", "maximum": 1}, {"type": "number", "exclusiveMinimum": 1}, None, [], True),
    ({"type": "number", "maximum": 1}, {"type": "number", "minimum": 1}, None, [], False),
    ({"$ref": "#/definitions/s"}, {"type": ["null", "boolean"]}, None, [], True),
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, {"properties": {"a": False}}, None, [], True),
]


@pytest.mark.parametrize("a, b, types, required, proven", PAIRS, ids=[f"pair{i}" for i in range(len(PAIRS))])
def test_disjoint_proves_only_what_holds(
    a: Any, b: Any, types: set[str] | None, required: list[str], proven: bool
) -> None:
    assert disjoint(a, b, types, _resolve, _valid, frozenset(required)) == proven
    assert not disjoint(
        {"type": "number", "maximum": 1},
        {"type": "number", "exclusiveMinimum": 1},
        None,
        _resolve,
        _valid,
        draft_4=True,
    )
    if proven:  # no value of the types beside them, with the names beside them, matches both
        beside = {"type": sorted(types)} if types else {}
        beside = {**beside, "required": required} if required else beside
        values: list[Any] = [
            None,
            True,
            0,
            1,
            2,
            3,
            1.5,
            "",
            "ab",
            [],
            {"a": 1},
            {"k": "x"},
            {"k": "y", "a": 2},
            {"b": 1},
        ]
        for value in values:
            assert not (_valid(beside, value) and _valid(a, value) and _valid(b, value)), value
