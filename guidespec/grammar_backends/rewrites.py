"""Exact rewrites of a JSON schema before a backend compiles it: each gives a schema that accepts
exactly the same JSON values, in a form the backends can enforce. Where a rewrite cannot be
exact it does nothing, and the backend refuses as before.

- **Double negation**: ``{"not": {"not": S}}`` is ``S``.
- **A finite set of values**: a schema node with ``enum`` or ``const`` (or an ``allOf`` with such
  a branch) and other keywords beside it (``not``, ``pattern``, ``minLength``, ...) accepts
  exactly those of its values that the whole node accepts: it becomes ``enum`` of those, each
  checked by the ``jsonschema`` library against the node (nodes with a ``$ref``, or a keyword whose
  meaning depends on the draft, or ``format``, are left alone).
- **Dependencies**: ``dependencies`` / ``dependentRequired`` / ``dependentSchemas`` become, per
  name, an ``anyOf`` of "absent" (``properties: {name: false}``) and "present with what it needs"
  (xgrammar still refuses the result; llguidance enforces it, so backend ``auto`` serves it).
- **``not`` of a type**: ``{"not": {"type": T}}`` is ``type`` of the other JSON types (not where
  T names ``integer`` without ``number``: "a number that is not an integer" has no type).

``rewrite_schema`` returns the schema and the names of the rewrites applied (for the note and
the tests, which check each one's equivalence on the dataset's instances).
"""

from __future__ import annotations

import copy
from typing import Any

import jsonschema

_TYPES = ("null", "boolean", "object", "array", "string", "number")
_ANNOTATIONS = {"title", "description", "$comment", "examples", "default", "$id", "$schema", "$anchor", "deprecated",
                "readOnly", "writeOnly"}
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
# validation keywords that can narrow an enum (beside "type", which every backend enforces with it)
_VALIDATION = {"not", "pattern", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
               "multipleOf", "minItems", "maxItems", "uniqueItems", "items", "contains", "minContains", "maxContains",
               "properties", "patternProperties", "additionalProperties", "required", "minProperties",
               "maxProperties", "propertyNames", "allOf", "anyOf", "oneOf", "if", "then", "else"}
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
_SUBSCHEMAS = ("not", "items", "additionalProperties", "contains", "propertyNames", "if", "then", "else",
               "additionalItems", "unevaluatedItems", "unevaluatedProperties")


def rewrite_schema(schema: Any) -> tuple[Any, list[str]]:
    applied: list[str] = []
    return _walk(copy.deepcopy(schema), applied), applied


def _walk(node: Any, applied: list[str]) -> Any:
    if not isinstance(node, dict):
        return node
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            node[key] = [_walk(s, applied) for s in node[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {name: _walk(s, applied) for name, s in node[key].items()}
    for key in _SUBSCHEMAS:
        if key in node:
            node[key] = _walk(node[key], applied)
    if isinstance(node.get("items"), list):
        node["items"] = [_walk(s, applied) for s in node["items"]]
    node = _double_negation(node, applied)
    node = _not_type(node, applied)
    node = _dependencies(node, applied)
    return _finite_values(node, applied)


def _double_negation(node: dict[str, Any], applied: list[str]) -> dict[str, Any]:
    inner = node.get("not")
    if not (isinstance(inner, dict) and set(inner) == {"not"}):
        return node
    kept = inner["not"]
    rest = {k: v for k, v in node.items() if k != "not"}
    applied.append("double negation")
    if not rest:
        return kept if isinstance(kept, dict) else {"allOf": [kept]}
    rest["allOf"] = [*rest.get("allOf", []), kept] if isinstance(rest.get("allOf", []), list) else [kept]
    return rest


def _not_type(node: dict[str, Any], applied: list[str]) -> dict[str, Any]:
    inner = node.get("not")
    if not (isinstance(inner, dict) and set(inner) == {"type"}):
        return node
    excluded = inner["type"] if isinstance(inner["type"], list) else [inner["type"]]
    if not all(isinstance(t, str) and (t in _TYPES or t == "integer") for t in excluded):
        return node
    if "integer" in excluded and "number" not in excluded:
        return node  # "a number that is not an integer" is no type
    own = node.get("type", list(_TYPES))
    own = own if isinstance(own, list) else [own]
    if not all(isinstance(t, str) for t in own):
        return node
    kept = [t for t in own if t not in excluded and not (t == "integer" and "number" in excluded)]
    if not kept:
        return node  # nothing is left: let the backend say the schema cannot be met
    out = {k: v for k, v in node.items() if k != "not"}
    out["type"] = kept[0] if len(kept) == 1 else kept
    applied.append("not of a type")
    return out


def _dependencies(node: dict[str, Any], applied: list[str]) -> dict[str, Any]:
    """``dependencies`` / ``dependentRequired`` / ``dependentSchemas``: for each name, an ``anyOf``
    of "the name is absent" (``properties: {name: false}``) and "present, with its dependants"
    (``required`` of the name and the names it needs, or the name and the schema it needs)."""
    branches: list[Any] = []
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        value = node.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            return node
        for name, need in value.items():
            absent = {"properties": {name: False}}
            if isinstance(need, list) and key != "dependentSchemas" and all(isinstance(n, str) for n in need):
                present: Any = {"required": [name, *need]}
            elif isinstance(need, (dict, bool)) and key != "dependentRequired":
                present = {"allOf": [{"required": [name]}, need]}
            else:
                return node
            branches.append({"anyOf": [absent, present]})
    if not branches:
        return node
    if "allOf" in node and not isinstance(node["allOf"], list):
        return node
    out = {k: v for k, v in node.items() if k not in ("dependencies", "dependentRequired", "dependentSchemas")}
    out["allOf"] = [*out.get("allOf", []), *branches]
    applied.append("dependencies")
    return out


def _finite_values(node: dict[str, Any], applied: list[str]) -> dict[str, Any]:
    values = _values_of(node)
    if values is None or _contains(node, _REFS | _SENSITIVE):
        return node
    if not _VALIDATION & set(node):  # (an enum beside its type needs nothing: every backend enforces both)
        return node
    try:
        validator = jsonschema.validators.validator_for(node, default=jsonschema.Draft202012Validator)(node)
        kept = [v for v in values if validator.is_valid(v)]
    except Exception:  # a schema jsonschema cannot evaluate: leave it to the backend
        return node
    if not kept:
        return node
    out = {k: v for k, v in node.items() if k in _ANNOTATIONS}
    out["enum"] = kept
    applied.append("finite values")
    return out


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


# keywords whose meaning depends on the draft (or that jsonschema treats as annotations while a
# backend enforces them): a node holding one is not evaluated here
_SENSITIVE = {"prefixItems", "additionalItems", "dependencies", "dependentRequired", "dependentSchemas",
              "unevaluatedItems", "unevaluatedProperties", "$recursiveRef", "format", "contentEncoding",
              "contentMediaType"}


_REFS = {"$ref", "$dynamicRef"}


def _contains(node: Any, keywords: set[str]) -> bool:
    """Whether a schema holds one of ``keywords``, or ``items`` as a list (draft-dependent), anywhere."""
    if isinstance(node, dict):
        return (bool(keywords & set(node)) or isinstance(node.get("items"), list)
                or any(_contains(v, keywords) for v in node.values()))
    if isinstance(node, list):
        return any(_contains(v, keywords) for v in node)
    return False
