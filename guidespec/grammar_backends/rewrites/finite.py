"""Schemas with finitely many values, written as the ``enum`` of those values (each checked by
``jsonschema`` against the node): an ``enum`` or ``const`` with other keywords beside it, and an
integer node between two bounds with a keyword a backend cannot enforce. Where no value is left
the node is ``false``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from guidespec.grammar_backends.rewrites.context import ANNOTATIONS, TYPES, RewriteContext, contains


# validation keywords that can narrow an enum (beside "type", which every backend enforces with it)
_VALIDATION = {
    "not",
    "pattern",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minItems",
    "maxItems",
    "uniqueItems",
    "items",
    "contains",
    "minContains",
    "maxContains",
    "properties",
    "patternProperties",
    "additionalProperties",
    "required",
    "minProperties",
    "maxProperties",
    "propertyNames",
    "allOf",
    "anyOf",
    "oneOf",
    "if",
    "then",
    "else",
}


def finite_values(node: dict[str, Any], context: RewriteContext) -> Any:
    values = _values_of(node)
    if values is None or contains(node, _REFS | _SENSITIVE):
        return node
    if not (_VALIDATION | {"type"}) & set(node):
        return node
    try:
        if _VALIDATION & set(node):  # (the list the values came from need not check them again)
            listed = "enum" if isinstance(node.get("enum"), list) else "const" if "const" in node else None
            validator = context.validator({k: v for k, v in node.items() if k != listed})
            kept = [v for v in values if validator.is_valid(v)]
        else:  # a type alone: each value's own JSON type (a 20000-value enum in milliseconds)
            kept = [v for v in values if _has_type(v, node["type"], context.draft_4_integers)]
    except Exception:  # a schema jsonschema cannot evaluate: leave it to the backend
        return node
    if not kept:  # no value fits what is beside them: the node matches nothing
        if not context.use("finite values"):
            return node
        beside = sorted(k for k in node if k not in ANNOTATIONS and k not in ("enum", "const"))
        context.impossible.append(f"none of the values {_short(values)} fits the {', '.join(beside)} beside them")
        return False
    if len(kept) == len(values) and not _VALIDATION & set(node):
        return node  # (every value has the type beside them: every backend enforces the enum)
    out = {k: v for k, v in node.items() if k in ANNOTATIONS}
    out["enum"] = kept
    if not context.use("finite values"):
        return node
    return out


def _has_type(value: Any, types: Any, draft_4: bool) -> bool:
    """Whether a JSON value has one of ``types`` (a type name or a list of them), as JSON Schema
    reads it: 5.0 is an integer except in drafts 3 and 4; ``true`` is no number. An unknown type
    name raises (the caller leaves the node alone)."""
    names = [types] if isinstance(types, str) else list(types)
    for name in names:
        if name not in TYPES and name != "integer":
            raise ValueError(f"unknown type {name!r}")
        if (
            (name == "null" and value is None)
            or (name == "boolean" and isinstance(value, bool))
            or (name == "object" and isinstance(value, dict))
            or (name == "array" and isinstance(value, list))
            or (name == "string" and isinstance(value, str))
            or (name == "number" and isinstance(value, (int, float)) and not isinstance(value, bool))
            or (
                name == "integer"
                and not isinstance(value, bool)
                and (isinstance(value, int) or (isinstance(value, float) and value.is_integer() and not draft_4))
            )
        ):
            return True
    return False


def _short(values: list[Any]) -> str:
    text = json.dumps(values)
    return text if len(text) <= 80 else text[:77] + "..."


def _values_of(node: dict[str, Any]) -> list[Any] | None:
    """The node's finite set of candidate values: its own enum/const, or an allOf branch's."""
    if isinstance(node.get("enum"), list):
        return list(node["enum"])
    if "const" in node:
        return [node["const"]]
    for branch in node.get("allOf", []) if isinstance(node.get("allOf"), list) else []:
        if isinstance(branch, dict) and (isinstance(branch.get("enum"), list) or "const" in branch):
            return list(branch["enum"]) if isinstance(branch.get("enum"), list) else [branch["const"]]
    return None


_MAX_INTEGERS = 2000


def bounded_integers(node: dict[str, Any], context: RewriteContext) -> dict[str, Any]:
    """An integer node between two bounds, with a keyword left that a backend cannot enforce
    (``not``, ``oneOf``, ``if``...), becomes the ``enum`` of its valid integers (each checked by
    ``jsonschema``). Not in drafts 3 and 4, where 5.0 is no integer but equals the value 5."""
    if (
        node.get("type") != "integer"
        or not _UNENFORCEABLE & set(node)
        or context.draft_4_integers
        or "$ref" in node
        and context.legacy_refs
    ):  # (there the bounds beside the $ref do not count)
        return node
    low, high = _integer_bounds(node)
    if low is None or high is None or high - low + 1 > _MAX_INTEGERS or contains(node, _SENSITIVE):
        return node
    try:
        kept = [n for n in range(low, high + 1) if context.is_valid(node, n)]
    except Exception:  # a schema jsonschema cannot evaluate: leave it to the backend
        return node
    if not kept:
        return node
    if not context.use("bounded integers"):
        return node
    return {**{k: v for k, v in node.items() if k in ANNOTATIONS or k in ("definitions", "$defs")}, "enum": kept}


_UNENFORCEABLE = {"not", "oneOf", "if", "$ref", "allOf", "anyOf"}


def _integer_bounds(node: dict[str, Any]) -> tuple[int | None, int | None]:
    """The least and greatest integers the node's own bounds allow (None: unbounded)."""
    low = high = None
    for key, value in node.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            continue
        if key in ("minimum", "exclusiveMinimum"):
            bound = math.floor(value) + 1 if key == "exclusiveMinimum" else math.ceil(value)
            low = bound if low is None else max(low, bound)
        elif key in ("maximum", "exclusiveMaximum"):
            bound = math.ceil(value) - 1 if key == "exclusiveMaximum" else math.floor(value)
            high = bound if high is None else min(high, bound)
    return low, high


# keywords whose meaning depends on the draft (or that jsonschema treats as annotations while a
# backend enforces them): a node holding one is not evaluated here
_SENSITIVE = {
    "prefixItems",
    "additionalItems",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "unevaluatedItems",
    "unevaluatedProperties",
    "$recursiveRef",
    "format",
    "contentEncoding",
    "contentMediaType",
}


_REFS = {"$ref", "$dynamicRef"}
