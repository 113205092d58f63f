"""Every exact rewrite of ``grammar_backends/rewrites/`` accepts exactly what the schema it
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
from tests.grammar_backends.rewrites.cases import HAND

SCHEMAS = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "jsonschemabench" / "schemas"


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
