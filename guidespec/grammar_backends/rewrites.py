"""Exact rewrites of a JSON schema before a backend compiles it: each gives a schema that accepts
exactly the same JSON values, in a form the backends can enforce. Where a rewrite cannot be
exact it does nothing, and the backend refuses as before.

- **Double negation**: ``{"not": {"not": S}}`` is ``S``.
- **A finite set of values**: a schema node with ``enum`` or ``const`` (or an ``allOf`` with such
  a branch) and other keywords beside it (``type``, ``not``, ``pattern``, ``minLength``, ...)
  accepts exactly those of its values that the whole node accepts: it becomes ``enum`` of those,
  each checked by the ``jsonschema`` library against the node (nodes with a ``$ref``, or a keyword
  whose meaning depends on the draft, or ``format``, are left alone). xgrammar enforces an enum
  and drops a ``type`` beside it (``{"enum": ["M"], "type": "object"}`` accepted ``"M"``: issue 45).
  Where no value is left the node is ``false``.
- **Nothing matches**: a node that holds a part no value matches is ``false`` where that makes it
  match nothing: an object node that requires a property whose schema is ``false``, an ``allOf``
  with a ``false`` branch, an array node whose ``items`` is ``false`` and ``minItems`` positive; a
  ``false`` branch leaves an ``anyOf`` / ``oneOf`` (``false`` where none is left). A ``false``
  property that is not required stays, and the backends leave the name out. A whole schema that
  is ``false`` is refused (GrammarError, a 400) with the reason.
- **Dependencies**: ``dependencies`` / ``dependentRequired`` / ``dependentSchemas`` become, per
  name, an ``anyOf`` of "absent" (``properties: {name: false}``) and "present with what it needs"
  (xgrammar still refuses the result; llguidance enforces it, so backend ``auto`` serves it).
- **``not`` of a type**: ``{"not": {"type": T}}`` is ``type`` of the other JSON types (not where
  T names ``integer`` without ``number``: "a number that is not an integer" has no type).
- **``not``**: ``not: S`` is S's negation written with positive keywords (``negation.py``):
  ``not: {required: [a]}`` is ``properties: {a: false}``, the negation of listed strings a
  regex, of a range the ranges beside it, De Morgan for ``anyOf``/``allOf``.
- **``if``/``then``/``else``**: ``anyOf: [if and then, (not if) and else]``, where ``if`` negates.
- **``oneOf``**: as ``anyOf`` where that is exact: one branch; branches that list their values
  (the values exactly one branch accepts, as an ``enum``); branches proven pairwise disjoint
  (``disjoint.py``); else "branch i and no other", where every branch negates.
- **Unknown formats**: a ``format`` no draft defines is an annotation (dropped).
- **Beside a ``$ref``**: keywords no draft defines go; keywords the target repeats go; in a
  schema read in draft 2019-09 or later (``$schema``, or none) the rest become ``allOf`` with
  the reference. Drafts up to 7 ignore what is beside a ``$ref``: those schemas keep it, and what
  a rewrite adds to such a node stays beside the ``$ref`` as the keyword it replaces was.
- **Bounded integers**: an integer node between two bounds with a keyword a backend cannot
  enforce is the ``enum`` of its valid integers (at most 2000; not in drafts 3 and 4).
- **``minProperties``/``maxProperties`` of a closed object**: which optional names are present,
  as an ``anyOf`` of ``required`` (or absent) subsets, where there are at most 64.

``rewrite_schema`` returns the schema and the names of the rewrites applied (for the note and
the tests, which check each one's equivalence on the dataset's instances).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import urllib.parse
from itertools import combinations
from typing import Any

import jsonschema

from guidespec.grammar_backends.disjoint import disjoint
from guidespec.grammar_backends.interface import GrammarError
from guidespec.grammar_backends.negation import VALIDATION, any_of, conjoin, conjoin_all, negate

_TYPES = ("null", "boolean", "object", "array", "string", "number")
_ANNOTATIONS = {
    "title",
    "description",
    "$comment",
    "examples",
    "default",
    "$id",
    "$schema",
    "$anchor",
    "deprecated",
    "readOnly",
    "writeOnly",
}
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
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
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
_SUBSCHEMAS = (
    "not",
    "items",
    "additionalProperties",
    "contains",
    "propertyNames",
    "if",
    "then",
    "else",
    "additionalItems",
    "unevaluatedItems",
    "unevaluatedProperties",
)


REWRITES = (
    "double negation",
    "not of a type",
    "dependencies",
    "not",
    "if/then/else",
    "oneOf of one branch",
    "oneOf of finite branches",
    "oneOf of disjoint branches",
    "oneOf by negation",
    "unknown format",
    "annotations beside $ref",
    "keywords beside $ref its target repeats",
    "keywords beside $ref",
    "bounded integers",
    "min/maxProperties of a closed object",
    "finite values",
    "nothing matches",
)


def rewrite_schema(schema: Any, disabled: frozenset[str] = frozenset()) -> tuple[Any, list[str]]:
    """The schema rewritten, and the names of the rewrites applied (those named in ``disabled``
    are not: to measure what each one unlocks)."""
    context = _Context(copy.deepcopy(schema), [], disabled)
    root = context.root
    if not isinstance(root, dict):
        return root, []
    for key in ("definitions", "$defs"):  # first, so that a "$ref" resolves to a rewritten target
        if isinstance(root.get(key), dict):
            root[key] = {name: _walk(s, context) for name, s in root[key].items()}
    out = _walk(root, context, skip=("definitions", "$defs"))
    if out is False:
        raise GrammarError(
            "no JSON value can match this json_schema: " + "; ".join(dict.fromkeys(context.impossible))[:500]
        )
    return out, context.applied


@dataclasses.dataclass
class _Context:
    """The schema being rewritten (for its ``$ref`` targets) and the names of rewrites applied."""

    root: Any
    applied: list[str]
    disabled: frozenset[str] = frozenset()
    impossible: list[str] = dataclasses.field(default_factory=list)  # why nodes match nothing, for the refusal

    def use(self, rewrite: str) -> bool:
        """Whether to apply ``rewrite`` (not disabled); if so, it is recorded as applied."""
        if rewrite in self.disabled:
            return False
        self.applied.append(rewrite)
        return True

    @functools.cached_property
    def legacy_refs(self) -> bool:
        """Whether the schema is read in a draft (up to 7) that ignores the keywords beside a
        ``$ref``: as it says, or as ``jsonschema`` reads a schema with ``dependencies`` and no
        ``$schema`` (the tests' reading)."""
        declared = self.root.get("$schema") if isinstance(self.root, dict) else None
        if isinstance(declared, str):
            return any(f"draft-0{n}" in declared for n in (3, 4, 6, 7))
        return _contains(self.root, {"dependencies"})

    @functools.cached_property
    def draft_4_integers(self) -> bool:
        """Whether "integer" excludes 5.0 and ``exclusiveMinimum`` is a flag (drafts 3 and 4)."""
        declared = self.root.get("$schema") if isinstance(self.root, dict) else None
        return isinstance(declared, str) and ("draft-03" in declared or "draft-04" in declared)

    @functools.cached_property
    def has_nested_ids(self) -> bool:
        """A nested ``$id``/``id`` moves the base of the ``$ref``s under it: none is followed then."""
        return _nested_ids(self.root, top=True)

    def resolve(self, ref: str) -> Any:
        """The target of a local ``$ref`` ("#/definitions/x"), a copy; None for any other."""
        if not ref.startswith("#") or self.has_nested_ids:
            return None
        target = self.root
        for part in [p for p in ref[1:].split("/") if p] if ref != "#" else []:
            part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return None
        return copy.deepcopy(target)

    def is_valid(self, schema: Any, value: Any) -> bool:
        """Whether ``value`` is valid against ``schema`` (a part of the root), in the root's draft."""
        return bool(self.validator(schema).is_valid(value))

    def validator(self, schema: Any) -> Any:
        """A ``jsonschema`` validator of ``schema`` (a part of the root), in the root's draft."""
        return self._root_validator.evolve(schema=schema)

    @functools.cached_property
    def _root_validator(self) -> Any:
        default = jsonschema.Draft7Validator if self.legacy_refs else jsonschema.Draft202012Validator
        return jsonschema.validators.validator_for(self.root, default=default)(self.root)


def _walk(node: Any, context: _Context, skip: tuple[str, ...] = ()) -> Any:
    if not isinstance(node, dict):
        return node
    node = _double_negation(node, context)  # before the inner "not" is rewritten on its own
    if not isinstance(node, dict):
        return node
    as_written = {k: copy.deepcopy(node[k]) for k in ("not", "if") if k in node}  # (a negation may need either)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            node[key] = [_walk(s, context) for s in node[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict) and key not in skip:
            node[key] = {name: _walk(s, context) for name, s in node[key].items()}
    for key in _SUBSCHEMAS:
        if key in node:
            node[key] = _walk(node[key], context)
    if isinstance(node.get("items"), list):
        node["items"] = [_walk(s, context) for s in node["items"]]
    if isinstance(node.get("dependencies"), dict):  # its values: schemas, or lists of names
        node["dependencies"] = {name: _walk(s, context) for name, s in node["dependencies"].items()}
    node = _not(_dependencies(_not_type(node, context), context), context, as_written.get("not"))
    if isinstance(node, dict):
        node = _if_then_else(node, context, as_written.get("if"))
    for rewrite in (_one_of, _unknown_format, _ref_siblings, _bounded_integers, _counted_properties):
        if isinstance(node, dict):
            node = rewrite(node, context)
    if isinstance(node, dict):
        node = _finite_values(node, context)
    return _nothing_matches(node, context) if isinstance(node, dict) else node


def _double_negation(node: dict[str, Any], context: _Context) -> dict[str, Any]:
    inner = node.get("not")
    if not (isinstance(inner, dict) and set(inner) == {"not"}):
        return node
    kept = inner["not"]
    rest = {k: v for k, v in node.items() if k != "not"}
    if not context.use("double negation"):
        return node
    if not rest:
        return kept if isinstance(kept, dict) else {"allOf": [kept]}
    rest["allOf"] = [*rest.get("allOf", []), kept] if isinstance(rest.get("allOf", []), list) else [kept]
    return rest


def _not_type(node: dict[str, Any], context: _Context) -> dict[str, Any]:
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
    if not context.use("not of a type"):
        return node
    return out


def _dependencies(node: dict[str, Any], context: _Context) -> dict[str, Any]:
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
    if not context.use("dependencies"):
        return node
    return out


def _not(node: dict[str, Any], context: _Context, as_written: Any) -> Any:
    """``not: S`` becomes S's negation in positive keywords (``negation.py``): of S rewritten, or
    else of S as written (``not: {propertyNames: {not: {enum}}}``, whose inner ``not`` the
    rewrite of S has turned into a pattern)."""
    if "not" not in node:
        return node
    negated = _negation(node["not"], as_written, context)
    if negated is None:
        return node
    if not context.use("not"):
        return node
    return conjoin({k: v for k, v in node.items() if k != "not"}, negated)


def _negation(schema: Any, as_written: Any, context: _Context) -> Any:
    for candidate in (schema, as_written):
        negated = negate(candidate, context.resolve, draft_4=context.draft_4_integers)
        if negated is not None:
            return negated
    return None


def _if_then_else(node: dict[str, Any], context: _Context, as_written: Any) -> Any:
    """``if: I, then: T, else: E`` is ``anyOf: [I and T, (not I) and E]``."""
    if "if" not in node:
        return node
    negated = _negation(node["if"], as_written, context)
    if negated is None:
        return node
    chosen = any_of([conjoin_all([node["if"], node.get("then", True)]), conjoin_all([negated, node.get("else", True)])])
    if not context.use("if/then/else"):
        return node
    return conjoin({k: v for k, v in node.items() if k not in ("if", "then", "else")}, chosen)


_MAX_ONE_OF_CHARS = 200_000  # a oneOf by negation repeats every branch n times: not past this


def _one_of(node: dict[str, Any], context: _Context) -> Any:
    """``oneOf`` as ``anyOf``: of its one branch; of branches proven pairwise disjoint
    (``disjoint.py``); else of "branch i and not any other", where every branch negates."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or not branches:
        return node
    rest = {k: v for k, v in node.items() if k != "oneOf"}
    if len(branches) == 1:
        return conjoin(rest, branches[0]) if context.use("oneOf of one branch") else node
    values = _finite_branches(branches, context)
    if values:
        exactly_one = [v for v in values if sum(context.is_valid(b, v) for b in branches) == 1]
        if exactly_one and context.use("oneOf of finite branches"):
            return conjoin(rest, {"enum": exactly_one})
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
    required = (
        frozenset(n for n in node.get("required", []) if isinstance(n, str))
        if isinstance(node.get("required"), list)
        else frozenset()
    )
    if all(
        disjoint(a, b, types, context.resolve, context.is_valid, required, draft_4=context.draft_4_integers)
        for a, b in combinations(branches, 2)
    ) and context.use("oneOf of disjoint branches"):
        return conjoin(rest, {"anyOf": branches})
    negated = [negate(b, context.resolve, draft_4=context.draft_4_integers) for b in branches]
    if any(n is None for n in negated):
        return node
    exactly_one = any_of(
        [conjoin_all([b, *[n for j, n in enumerate(negated) if j != i]]) for i, b in enumerate(branches)]
    )
    if len(json.dumps(exactly_one)) > _MAX_ONE_OF_CHARS or not context.use("oneOf by negation"):
        return node
    return conjoin(rest, exactly_one)


def _finite_branches(branches: list[Any], context: _Context) -> list[Any] | None:
    """The values of branches that each list their values (``enum``/``const`` beside at most a
    ``type``, after ``$ref``s), in order, without repeats; None where a branch does not."""
    values: list[Any] = []
    for branch in branches:
        for _ in range(8):  # follow a chain of "$ref"s
            if not (isinstance(branch, dict) and set(branch) & VALIDATION == {"$ref"}):
                break
            branch = context.resolve(branch["$ref"]) if isinstance(branch["$ref"], str) else None
        if not isinstance(branch, dict) or set(branch) & VALIDATION - {"type"} not in ({"enum"}, {"const"}):
            return None
        if context.draft_4_integers and "integer" in json.dumps(branch.get("type")):
            return None  # there {"type": "integer", "enum": [1]} rejects 1.0, which an enum of 1 accepts
        listed = branch["enum"] if "enum" in branch else [branch["const"]]
        if not isinstance(listed, list):
            return None
        values += [v for v in listed if not any(_same_json(v, w) for w in values)]
    return values


def _same_json(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


_MAX_INTEGERS = 2000


def _bounded_integers(node: dict[str, Any], context: _Context) -> dict[str, Any]:
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
    if low is None or high is None or high - low + 1 > _MAX_INTEGERS or _contains(node, _SENSITIVE):
        return node
    try:
        kept = [n for n in range(low, high + 1) if context.is_valid(node, n)]
    except Exception:  # a schema jsonschema cannot evaluate: leave it to the backend
        return node
    if not kept:
        return node
    if not context.use("bounded integers"):
        return node
    return {**{k: v for k, v in node.items() if k in _ANNOTATIONS or k in ("definitions", "$defs")}, "enum": kept}


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


_MAX_SUBSETS = 64


def _counted_properties(node: dict[str, Any], context: _Context) -> Any:
    """``minProperties`` / ``maxProperties`` of an object closed to the names ``properties``
    lists (``additionalProperties: false``, no patterns): with R required names, "at least m"
    is "at least m - R of the optional names present", an ``anyOf`` of ``required`` subsets;
    "at most M" is "at least (optional - (M - R)) of them absent", an ``anyOf`` of
    ``properties: {name: false}`` subsets (where there are few subsets)."""
    counts = {k: node[k] for k in ("minProperties", "maxProperties") if k in node}
    properties, required = node.get("properties"), node.get("required", [])
    if (
        not counts
        or node.get("additionalProperties") is not False
        or "patternProperties" in node
        or "unevaluatedProperties" in node
        or not isinstance(properties, dict)
        or not isinstance(required, list)
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in counts.values())
        or not set(required) <= set(properties)
    ):
        return node
    optional = [n for n, sub in properties.items() if n not in required and sub is not False]
    need = counts.get("minProperties", 0) - len(set(required))
    spare = counts.get("maxProperties", len(properties)) - len(set(required))
    if need > len(optional) or spare < 0:
        return node  # no object can have that many properties: let the backend say so
    branches: list[list[Any]] = []
    if need > 0:
        branches.append([{"required": list(names)} for names in combinations(optional, need)])
    if spare < len(optional):
        absent = len(optional) - spare
        branches.append([{"properties": {n: False for n in names}} for names in combinations(optional, absent)])
    if any(len(b) > _MAX_SUBSETS for b in branches):
        return node
    if not context.use("min/maxProperties of a closed object"):
        return node
    out: Any = {k: v for k, v in node.items() if k not in counts}
    for subsets in branches:
        out = conjoin(out, any_of(subsets)) if isinstance(out, dict) else out
    return out


# the formats the JSON Schema drafts define (draft 3's own only in a draft-3 schema); any other
# "format" is an annotation every draft tells validators to ignore
_FORMATS = {
    "date-time",
    "date",
    "time",
    "duration",
    "email",
    "idn-email",
    "hostname",
    "idn-hostname",
    "ipv4",
    "ipv6",
    "uri",
    "uri-reference",
    "iri",
    "iri-reference",
    "uuid",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
    "regex",
}
_DRAFT_3_FORMATS = {"utc-millisec", "color", "style", "phone", "host-name", "ip-address"}


def _unknown_format(node: dict[str, Any], context: _Context) -> dict[str, Any]:
    value = node.get("format")
    if not isinstance(value, str) or value in _FORMATS:
        return node
    declared = context.root.get("$schema") if isinstance(context.root, dict) else None
    if value in _DRAFT_3_FORMATS and (not isinstance(declared, str) or "draft-03" in declared):
        return node
    if not context.use("unknown format"):
        return node
    return {k: v for k, v in node.items() if k != "format"}


# keywords beside a "$ref" that hold or locate schemas: kept where they are
_STRUCTURAL = {
    "definitions",
    "$defs",
    "$id",
    "id",
    "$schema",
    "$anchor",
    "$dynamicAnchor",
    "$recursiveAnchor",
    "$vocabulary",
}


def _ref_siblings(node: dict[str, Any], context: _Context) -> dict[str, Any]:
    """Beside a ``$ref``: keywords no draft defines (annotations) go; validation keywords, in a
    draft from 2019-09 on (where they apply with the reference), become ``allOf: [{$ref}, rest]``."""
    if "$ref" not in node:
        return node
    unknown = [k for k in node if k not in VALIDATION and k not in _STRUCTURAL]
    if unknown and context.use("annotations beside $ref"):
        node = {k: v for k, v in node.items() if k not in unknown}
    target = context.resolve(node["$ref"]) if isinstance(node["$ref"], str) else None
    repeated = [k for k in node if k != "$ref" and isinstance(target, dict) and k in target and target[k] == node[k]]
    if any(k in VALIDATION for k in repeated) and context.use("keywords beside $ref its target repeats"):
        node = {k: v for k, v in node.items() if k not in repeated}  # the target says it already: in every draft
    beside = [k for k in node if k in VALIDATION and k != "$ref"]
    if not beside or context.legacy_refs or ("allOf" in node and not isinstance(node["allOf"], list)):
        return node
    if not context.use("keywords beside $ref"):
        return node
    out = {k: v for k, v in node.items() if k != "$ref"}
    out["allOf"] = [*out.get("allOf", []), {"$ref": node["$ref"]}]
    return out


def _finite_values(node: dict[str, Any], context: _Context) -> Any:
    values = _values_of(node)
    if values is None or _contains(node, _REFS | _SENSITIVE):
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
        beside = sorted(k for k in node if k not in _ANNOTATIONS and k not in ("enum", "const"))
        context.impossible.append(f"none of the values {_short(values)} fits the {', '.join(beside)} beside them")
        return False
    if len(kept) == len(values) and not _VALIDATION & set(node):
        return node  # (every value has the type beside them: every backend enforces the enum)
    out = {k: v for k, v in node.items() if k in _ANNOTATIONS}
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
        if name not in _TYPES and name != "integer":
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


def _nothing_matches(node: dict[str, Any], context: _Context) -> Any:
    """``false`` for a node that no value can match because a part of it matches nothing (see
    "Nothing matches" above); the node without its ``false`` branches of ``anyOf`` / ``oneOf``."""
    out = node
    for key in ("anyOf", "oneOf"):
        branches = out.get(key)
        if isinstance(branches, list) and any(b is False for b in branches):
            if not context.use("nothing matches"):
                return node
            kept = [b for b in branches if b is not False]
            if not kept:
                context.impossible.append(f"no branch of an {key} can match")
                return False
            out = {**out, key: kept}
    why = None
    only = out.get("type")
    if isinstance(out.get("allOf"), list) and any(b is False for b in out["allOf"]):
        why = "a branch of an allOf matches nothing"
    elif only in ("object", ["object"]) and isinstance(out.get("properties"), dict):
        required: list[Any] = out["required"] if isinstance(out.get("required"), list) else []
        blocked = [n for n in required if isinstance(n, str) and out["properties"].get(n, True) is False]
        if blocked:
            why = f"required property {blocked[0]!r} can have no value"
    elif only in ("array", ["array"]) and out.get("items") is False:
        low = out.get("minItems", 0)
        if isinstance(low, (int, float)) and low > 0:
            why = "items matches nothing and minItems is positive"
    if why is None:
        return out
    if not context.use("nothing matches"):
        return node
    context.impossible.append(why)
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


def _contains(node: Any, keywords: set[str]) -> bool:
    """Whether a schema holds one of ``keywords``, or ``items`` as a list (draft-dependent), anywhere."""
    if isinstance(node, dict):
        return (
            bool(keywords & set(node))
            or isinstance(node.get("items"), list)
            or any(_contains(v, keywords) for v in node.values())
        )
    if isinstance(node, list):
        return any(_contains(v, keywords) for v in node)
    return False


def _nested_ids(node: Any, top: bool) -> bool:
    if isinstance(node, list):
        return any(_nested_ids(v, False) for v in node)
    if not isinstance(node, dict):
        return False
    if not top and any(isinstance(node.get(k), str) and not str(node[k]).startswith("#") for k in ("$id", "id")):
        return True
    return any(_nested_ids(v, False) for k, v in node.items() if k not in _ANNOTATIONS and k not in ("enum", "const"))
