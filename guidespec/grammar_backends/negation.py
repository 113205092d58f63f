"""The exact negation of a JSON schema, written with positive keywords only, for the rewrites
of ``rewrites/logic.py`` (``not``, ``if``/``then``/``else``, ``oneOf``); neither backend enforces
``not`` itself.

A schema is the conjunction of its keywords, and each keyword constrains only the values of
one JSON type (``minLength`` says nothing about a number), so ``not S`` is the union, over S's
keywords, of "a value of that keyword's type which breaks it": ``not {"minLength": 2}`` is
``{"type": "string", "maxLength": 1}``, ``not {"required": ["a"]}`` is ``{"type": "object",
"properties": {"a": false}}``. Compositions follow De Morgan's laws; a local ``$ref`` is
negated through its target. What this module cannot negate exactly (``pattern`` and
``propertyNames`` but for a form each, ``multipleOf``, ``format``, ``uniqueItems``,
``additionalProperties``, an object or array among forbidden values, ...) makes ``negate``
return None, and the caller leaves the schema for the backends to refuse. It does not simplify
what it builds beyond dropping branches that are ``false``.

It also writes a conjunction (``conjoin``) the way the backends read best: keywords merged into
one schema where none clashes, else one more ``allOf`` branch.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

TYPES = ("null", "boolean", "object", "array", "string", "number")
Resolve = Callable[[str], Any]  # a "$ref" -> its target schema, or None where it cannot be found

# every keyword that constrains a value in some draft (3 to 2020-12); any other keyword is an
# annotation (or unknown, hence ignored by validators)
VALIDATION = {
    "type",
    "enum",
    "const",
    "multipleOf",
    "maximum",
    "exclusiveMaximum",
    "minimum",
    "exclusiveMinimum",
    "maxLength",
    "minLength",
    "pattern",
    "items",
    "additionalItems",
    "prefixItems",
    "maxItems",
    "minItems",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "maxProperties",
    "minProperties",
    "required",
    "properties",
    "patternProperties",
    "additionalProperties",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "propertyNames",
    "if",
    "then",
    "else",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "$ref",
    "$dynamicRef",
    "$recursiveRef",
    "format",
    "unevaluatedItems",
    "unevaluatedProperties",
    "disallow",
    "extends",
    "divisibleBy",
    "contentEncoding",
    "contentMediaType",
    "contentSchema",
}
_MAX_DEPTH = 12  # of "$ref"s followed: deeper (or recursive) targets are not negated
_BOUNDS = {
    "minimum": "exclusiveMaximum",
    "exclusiveMinimum": "maximum",
    "maximum": "exclusiveMinimum",
    "exclusiveMaximum": "minimum",
}
_LENGTHS = {
    "minLength": ("string", "maxLength"),
    "maxLength": ("string", "minLength"),
    "minItems": ("array", "maxItems"),
    "maxItems": ("array", "minItems"),
    "minProperties": ("object", "maxProperties"),
    "maxProperties": ("object", "minProperties"),
}
_LINE_ENDS = "\n\r\u2028\u2029"


def negate(schema: Any, resolve: Resolve, depth: int = 0, draft_4: bool = False) -> Any:
    """A schema accepting exactly the JSON values ``schema`` rejects, or None. ``draft_4``: the
    schema is read in draft 3 or 4, where ``exclusiveMinimum`` is a flag: no bound is negated."""
    if isinstance(schema, bool):
        return not schema
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None
    if "$ref" in schema and VALIDATION & set(schema) - {"$ref"}:
        return None  # the keywords beside a "$ref" count or not by the draft: not negated
    if "if" not in schema and ("then" in schema or "else" in schema):
        schema = {k: v for k, v in schema.items() if k not in ("then", "else")}  # ignored without an "if"
    branches: list[Any] = []
    for key, value in schema.items():
        if key not in VALIDATION:
            continue
        negated = _negate_keyword(key, value, schema, resolve, depth, draft_4)
        if negated is None:
            return None
        branches += negated
    return any_of(branches)


def any_of(branches: list[Any]) -> Any:
    """``anyOf`` of the branches, without the ``false`` ones; ``false`` if none is left."""
    kept = [b for b in branches if b is not False]
    if any(b is True or b == {} for b in kept):
        return True
    if not kept:
        return False
    return kept[0] if len(kept) == 1 else {"anyOf": kept}


def all_of(branches: list[Any]) -> Any:
    """``allOf`` of the branches, without the ``true`` ones; ``false`` if one is ``false``."""
    kept = [b for b in branches if b is not True and b != {}]
    if any(b is False for b in kept):
        return False
    if not kept:
        return True
    return kept[0] if len(kept) == 1 else {"allOf": kept}


# keywords that must be read together (properties with additionalProperties, ...): merged into a
# node only where the node has none of the same group
_GROUPS = (
    {"properties", "patternProperties", "additionalProperties", "unevaluatedProperties"},
    {"items", "prefixItems", "additionalItems", "unevaluatedItems"},
    {"contains", "minContains", "maxContains"},
    {"if", "then", "else"},
)


def conjoin(node: dict[str, Any], extra: Any) -> Any:
    """A schema meaning ``node and extra``: extra's keywords merged in where none clashes (the
    names of ``required`` are joined), else extra as one more ``allOf`` branch. Beside a ``$ref``
    extra stays beside it, as the keyword it replaces was: drafts up to 7 ignore both alike."""
    if extra is True or extra == {}:
        return node
    if "$ref" in node:
        earlier = node.get("allOf", [])
        return {**node, "allOf": [*(earlier if isinstance(earlier, list) else [earlier]), extra]}
    if extra is False:
        return False
    if isinstance(extra, dict) and set(extra) == {"anyOf"} and isinstance(extra["anyOf"], list):
        extra = any_of(_possible(extra["anyOf"], node.get("type")))  # (branches of another type go)
        if extra is True or extra is False:
            return node if extra is True else False
    if isinstance(extra, dict) and "$ref" not in extra and not _clash(node, extra):
        out = dict(node)
        for key, value in extra.items():
            out[key] = list(dict.fromkeys([*out[key], *value])) if key == "required" and key in out else value
        return out
    if "allOf" in node and not isinstance(node["allOf"], list):
        return {"allOf": [node, extra]}
    return {**node, "allOf": [*node.get("allOf", []), extra]}


def conjoin_all(schemas: list[Any]) -> Any:
    out: Any = True
    for schema in schemas:
        out = schema if out is True else conjoin(out, schema) if isinstance(out, dict) else out
    return out


def _possible(branches: list[Any], own: Any) -> list[Any]:
    """The branches whose ``type`` allows a value of type ``own`` (a node's type keyword)."""
    ours = _type_set(own)

    def possible(branch: Any) -> bool:
        theirs = _type_set(branch.get("type")) if isinstance(branch, dict) else None
        return ours is None or theirs is None or bool(ours & theirs)

    return [b for b in branches if possible(b)]


def _type_set(value: Any) -> set[str] | None:
    """The types a "type" keyword names, "integer" as well where it names "number"."""
    named = value if isinstance(value, list) else [value] if isinstance(value, str) else None
    if named is None or not all(isinstance(t, str) for t in named):
        return None
    return set(named) | ({"integer"} if "number" in named else set())


def _clash(node: dict[str, Any], extra: dict[str, Any]) -> bool:
    if any(
        k in node and node[k] != v and not (k == "required" and isinstance(node[k], list) and isinstance(v, list))
        for k, v in extra.items()
    ):
        return True
    return any(group & set(node) and group & set(extra) for group in _GROUPS)


def _negate_keyword(
    key: str, value: Any, schema: dict[str, Any], resolve: Resolve, depth: int, draft_4: bool
) -> list[Any] | None:
    """The values that break keyword ``key`` alone, as a list of branches (of an anyOf)."""
    if key == "type":
        return _not_types(value)
    if key in ("enum", "const"):
        return _not_values(value if key == "enum" else [value], draft_4)
    if key == "required":
        if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
            return None
        return [{"type": "object", "properties": {name: False}} for name in value]
    if key == "properties":
        return _not_properties(value, resolve, depth, draft_4)
    if key in _BOUNDS:
        if not _is_number(value) or draft_4:
            return None  # a draft-4 boolean exclusiveMinimum: not handled
        return [{"type": "number", _BOUNDS[key]: value}]
    if key in _LENGTHS:
        if not isinstance(value, int) or isinstance(value, bool):
            return None
        kind, opposite = _LENGTHS[key]
        if key.startswith("min"):
            return [{"type": kind, opposite: value - 1}] if value > 0 else []
        return [{"type": kind, opposite: value + 1}]
    if key == "pattern":
        return _not_pattern(value)
    if key == "propertyNames":
        return _not_property_names(value)
    if key == "contains" and not ({"minContains", "maxContains"} & set(schema)):
        inner = negate(value, resolve, depth, draft_4)  # no item matches: every item breaks it
        return None if inner is None else [{"type": "array", "items": inner}]
    return _negate_composition(key, value, schema, resolve, depth, draft_4)


def _negate_composition(
    key: str, value: Any, schema: dict[str, Any], resolve: Resolve, depth: int, draft_4: bool
) -> list[Any] | None:
    if key == "not":
        return [value]
    if key in ("anyOf", "allOf") and isinstance(value, list):
        negated = [negate(branch, resolve, depth, draft_4) for branch in value]
        if any(n is None for n in negated):
            return None
        return [all_of(negated)] if key == "anyOf" else negated
    if key == "$ref" and isinstance(value, str):
        target = resolve(value)
        through = None if target is None else negate(target, resolve, depth + 1, draft_4)
        return None if through is None else [through]
    if key == "if" and "then" not in schema and "else" not in schema:
        return []  # an "if" alone constrains nothing
    if key == "additionalProperties" and value in (True, {}):
        return []
    if key == "patternProperties" and isinstance(value, dict) and all(v in (True, {}) for v in value.values()):
        return []
    return None


def _not_types(value: Any) -> list[Any] | None:
    named = value if isinstance(value, list) else [value]
    if not all(isinstance(t, str) and (t in TYPES or t == "integer") for t in named):
        return None
    if "integer" in named and "number" not in named:
        return None  # "a number that is not an integer" has no type
    others = [t for t in TYPES if t not in named]
    return [{"type": others[0] if len(others) == 1 else others}] if others else []


def _not_properties(value: Any, resolve: Resolve, depth: int, draft_4: bool) -> list[Any] | None:
    """Some named property is present and breaks its schema."""
    if not isinstance(value, dict):
        return None
    branches: list[Any] = []
    for name, sub in value.items():
        negated = negate(sub, resolve, depth, draft_4)
        if negated is None:
            return None
        if negated is True:
            branches.append({"type": "object", "required": [name]})
        elif negated is not False:
            branches.append({"type": "object", "required": [name], "properties": {name: negated}})
    return branches


def _not_property_names(value: Any) -> list[Any] | None:
    """Some name breaks ``propertyNames``: where it allows no name, any name (an object with a
    property); where it allows every name but a listed few (``not`` of ``enum``/``const``), one
    of those is present."""
    if value is True or value == {}:
        return []
    if value is False:
        return [{"type": "object", "minProperties": 1}]
    inner = value.get("not") if isinstance(value, dict) and set(value) == {"not"} else None
    if isinstance(inner, dict) and set(inner) in ({"enum"}, {"const"}):
        names = inner["enum"] if "enum" in inner else [inner["const"]]
        if isinstance(names, list):
            return [{"type": "object", "required": [n]} for n in names if isinstance(n, str)]
    return None


def _not_values(values: Any, draft_4: bool) -> list[Any] | None:
    """Every value but the listed ones: the other types whole, and per listed type its complement
    (the other boolean; numbers outside the listed points; strings a regex excludes)."""
    if not isinstance(values, list):
        return None
    listed = {_type_of(v) for v in values}
    if "array" in listed or "object" in listed:
        return None
    others = [t for t in TYPES if t not in listed]
    branches: list[Any] = [{"type": others[0] if len(others) == 1 else others}] if others else []
    booleans = {v for v in values if isinstance(v, bool)}
    if len(booleans) == 1:
        branches.append({"const": not next(iter(booleans))})
    numbers = sorted({v for v in values if _is_number(v)})
    if numbers:
        if not all(math.isfinite(n) for n in numbers) or draft_4:
            return None
        branches.append({"type": "number", "exclusiveMaximum": numbers[0]})
        branches += [
            {"type": "number", "exclusiveMinimum": a, "exclusiveMaximum": b} for a, b in zip(numbers, numbers[1:])
        ]
        branches.append({"type": "number", "exclusiveMinimum": numbers[-1]})
    strings = [v for v in values if isinstance(v, str)]
    if strings:
        if any(c in s for s in strings for c in _LINE_ENDS):
            return None  # (regex engines disagree on "$" before a final newline)
        branches.append({"type": "string", "pattern": "^" + other_strings(strings) + "$"})
    return branches


def other_strings(strings: list[str]) -> str:
    """A regex (no anchors, no lookaround) matching exactly the strings not in ``strings``."""
    trie: dict[str, Any] = {}
    for s in strings:
        node = trie
        for c in s:
            node = node.setdefault(c, {})
        node[""] = {}
    return _other_suffixes(trie)


def _other_suffixes(node: dict[str, Any]) -> str:
    """Suffixes that do not finish a listed string from this trie node."""
    chars = sorted(c for c in node if c)
    parts = [] if "" in node else [""]
    if chars:
        parts.append("[^" + "".join(_class_char(c) for c in chars) + r"][\s\S]*")
        parts += [re.escape(c) + _group(_other_suffixes(node[c])) for c in chars]
    else:
        parts.append(r"[\s\S]+")
    return _group("|".join(parts))


def _group(regex: str) -> str:
    return "(" + regex + ")"


def _class_char(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else c


def _not_pattern(pattern: Any) -> list[Any] | None:
    """Only ``^[C]+$`` / ``^[C]*$`` (one character class, or ``\\s``-like escape, repeated),
    where C holds the newline (so no engine's "$" differs): its complement is "empty" (for +)
    or "holds a character outside C"."""
    if not isinstance(pattern, str):
        return None
    match = re.fullmatch(r"\^\[(\^?)((?:\\.|[^\]\\])+)\]([+*])\$", pattern)
    if match is None or match.group(1):
        return None
    members = match.group(2)
    try:
        if not re.fullmatch("[" + members + "]", "\n"):
            return None
    except re.error:
        return None
    outside = {"type": "string", "pattern": "[^" + members + "]"}
    return [outside, {"type": "string", "maxLength": 0}] if match.group(3) == "+" else [outside]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if _is_number(value):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"
