"""Proofs that two JSON schemas share no value, for the ``oneOf`` rewrite of ``rewrites/logic.py``:
a ``oneOf`` whose branches are pairwise disjoint is their ``anyOf``.

Two schemas are disjoint here when, for every JSON type both allow, one of these holds: their
listed values (``const``/``enum``) all fail the other schema (checked with ``jsonschema``); for
objects, a property one requires is one the other forbids (``properties: {name: false}``, or
``additionalProperties: false`` without the name), or both require it with disjoint schemas (a
discriminator); for numbers, their ranges do not meet. A proof only uses keywords that hold
(``$ref`` targets and ``allOf`` branches are followed; keywords beside a ``$ref``, whose meaning
depends on the draft, are not used), so "not proven" is the only way to be wrong, and the
caller then leaves the ``oneOf`` alone.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from guidespec.grammar_backends.negation import TYPES, Resolve

IsValid = Callable[[Any, Any], bool]  # (schema, value) -> whether the value is valid, in the root's draft
_MAX_DEPTH = 8


def disjoint(
    a: Any,
    b: Any,
    types: set[str] | None,
    resolve: Resolve,
    is_valid: IsValid,
    required: frozenset[str] = frozenset(),
    depth: int = 0,
    draft_4: bool = False,
) -> bool:
    """True if no value of a type in ``types`` (all where None) with the ``required`` property
    names (of the schema beside the two) can match both schemas. ``draft_4``: read in draft 3
    or 4, where a number as ``exclusiveMinimum`` is no bound."""
    if depth > _MAX_DEPTH:
        return False
    first, second = _conjuncts(a, resolve), _conjuncts(b, resolve)
    if first is None or second is None:
        return False
    if False in first or False in second:
        return True
    shared = _intersect(_intersect(_types(first), _types(second)), types)
    if shared is None:
        shared = set(TYPES)
    if not shared:
        return True
    if _values_fail(first, b, is_valid) or _values_fail(second, a, is_valid):
        return True
    return all(
        _disjoint_as(
            t,
            first + [{"required": sorted(required)}],
            second + [{"required": sorted(required)}],
            resolve,
            is_valid,
            depth,
            draft_4,
        )
        for t in shared
    )


def _disjoint_as(
    kind: str, first: list[Any], second: list[Any], resolve: Resolve, is_valid: IsValid, depth: int, draft_4: bool
) -> bool:
    if kind == "object":
        return _objects_disjoint(first, second, resolve, is_valid, depth, draft_4)
    if kind in ("number", "integer"):
        return _ranges_disjoint(_range(first, draft_4), _range(second, draft_4))
    return False


def _conjuncts(schema: Any, resolve: Resolve, depth: int = 0) -> list[Any] | None:
    """The schemas whose conjunction ``schema`` is: itself, its ``allOf`` branches and its
    ``$ref`` target, recursively (None where a reference cannot be followed)."""
    if isinstance(schema, bool):
        return [schema]
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None
    if "$ref" in schema:  # only the target: what is beside it counts in some drafts only
        target = resolve(schema["$ref"]) if isinstance(schema["$ref"], str) else None
        return None if target is None else _conjuncts(target, resolve, depth + 1)
    out: list[Any] = [schema]
    for branch in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        more = _conjuncts(branch, resolve, depth + 1)
        if more is not None:  # (a branch not followed only proves less)
            out += more
    return out


def _types(conjuncts: list[Any]) -> set[str] | None:
    """The JSON types all conjuncts allow ("integer" kept apart from "number"), None for any."""
    allowed: set[str] | None = None
    for schema in conjuncts:
        if isinstance(schema, dict) and "type" in schema:
            named = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            if all(isinstance(t, str) for t in named):
                allowed = _intersect(allowed, set(named))
    return allowed


def _intersect(a: set[str] | None, b: set[str] | None) -> set[str] | None:
    if a is None or b is None:
        return b if a is None else a
    out = a & b
    if "number" in a and "integer" in b or "number" in b and "integer" in a:
        out.add("integer")
    return out


def _values_fail(conjuncts: list[Any], other: Any, is_valid: IsValid) -> bool:
    """Every value some conjunct lists (``const`` / ``enum``) fails the other schema."""
    for schema in conjuncts:
        if isinstance(schema, dict) and ("const" in schema or isinstance(schema.get("enum"), list)):
            values = [schema["const"]] if "const" in schema else schema["enum"]
            try:
                return not any(is_valid(other, v) for v in values)
            except Exception:  # a schema jsonschema cannot evaluate: no proof
                return False
    return False


def _objects_disjoint(
    first: list[Any], second: list[Any], resolve: Resolve, is_valid: IsValid, depth: int, draft_4: bool
) -> bool:
    required_first, required_second = _required(first), _required(second)
    if any(_forbids(second, n) for n in required_first) or any(_forbids(first, n) for n in required_second):
        return True
    for name in required_first & required_second:
        for a in _property_schemas(first, name):
            if any(
                disjoint(a, b, None, resolve, is_valid, depth=depth + 1, draft_4=draft_4)
                for b in _property_schemas(second, name)
            ):
                return True
    return False


def _required(conjuncts: list[Any]) -> set[str]:
    return {
        n
        for s in conjuncts
        if isinstance(s, dict) and isinstance(s.get("required"), list)
        for n in s["required"]
        if isinstance(n, str)
    }


def _property_schemas(conjuncts: list[Any], name: str) -> list[Any]:
    return [
        s["properties"][name]
        for s in conjuncts
        if isinstance(s, dict) and isinstance(s.get("properties"), dict) and name in s["properties"]
    ]


def _forbids(conjuncts: list[Any], name: str) -> bool:
    """Some conjunct forbids property ``name``."""
    for schema in conjuncts:
        if not isinstance(schema, dict):
            continue
        properties: dict[str, Any] = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
        if properties.get(name) is False:
            return True
        if schema.get("additionalProperties") is False and name not in properties:
            patterns = schema.get("patternProperties", {})
            if isinstance(patterns, dict) and not any(_may_match(p, name) for p in patterns):
                return True
    return False


def _may_match(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return True  # unknown: assume it matches


_Range = tuple[float, bool, float, bool]  # low, low exclusive, high, high exclusive


def _range(conjuncts: list[Any], draft_4: bool) -> _Range:
    low: float = -float("inf")
    high: float = float("inf")
    low_open = high_open = False
    for schema in conjuncts:
        if not isinstance(schema, dict):
            continue
        for key, exclusive in (("minimum", False), ("exclusiveMinimum", True))[: 1 if draft_4 else 2]:
            value = schema.get(key)
            if (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and (value > low or value == low and exclusive)
            ):
                low, low_open = value, exclusive
        for key, exclusive in (("maximum", False), ("exclusiveMaximum", True))[: 1 if draft_4 else 2]:
            value = schema.get(key)
            if (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and (value < high or value == high and exclusive)
            ):
                high, high_open = value, exclusive
    return low, low_open, high, high_open


def _ranges_disjoint(a: _Range, b: _Range) -> bool:
    return _below(a[2], a[3], b[0], b[1]) or _below(b[2], b[3], a[0], a[1])


def _below(high: float, high_open: bool, low: float, low_open: bool) -> bool:
    """Every number up to ``high`` is below every number from ``low``."""
    return high < low or high == low and (high_open or low_open)
