"""The logical keywords rewritten as ``anyOf`` / ``allOf`` of positive keywords, which the
backends enforce: a double negation, ``not`` of a type, ``not`` (``grammar_backends/negation.py``),
``if``/``then``/``else`` and ``oneOf`` (of one branch, of branches that list their values, of
branches proven disjoint by ``grammar_backends/disjoint.py``, else by negation).
"""

from __future__ import annotations

import json
from itertools import combinations
from typing import Any

from guidespec.grammar_backends.disjoint import disjoint
from guidespec.grammar_backends.negation import VALIDATION, any_of, conjoin, conjoin_all, negate
from guidespec.grammar_backends.rewrites.context import TYPES, RewriteContext


def double_negation(node: dict[str, Any], context: RewriteContext) -> dict[str, Any]:
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


def not_type(node: dict[str, Any], context: RewriteContext) -> dict[str, Any]:
    inner = node.get("not")
    if not (isinstance(inner, dict) and set(inner) == {"type"}):
        return node
    excluded = inner["type"] if isinstance(inner["type"], list) else [inner["type"]]
    if not all(isinstance(t, str) and (t in TYPES or t == "integer") for t in excluded):
        return node
    if "integer" in excluded and "number" not in excluded:
        return node  # "a number that is not an integer" is no type
    own = node.get("type", list(TYPES))
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


def not_keyword(node: dict[str, Any], context: RewriteContext, as_written: Any) -> Any:
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


def _negation(schema: Any, as_written: Any, context: RewriteContext) -> Any:
    for candidate in (schema, as_written):
        negated = negate(candidate, context.resolve, draft_4=context.draft_4_integers)
        if negated is not None:
            return negated
    return None


def if_then_else(node: dict[str, Any], context: RewriteContext, as_written: Any) -> Any:
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


def one_of(node: dict[str, Any], context: RewriteContext) -> Any:
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


def _finite_branches(branches: list[Any], context: RewriteContext) -> list[Any] | None:
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
