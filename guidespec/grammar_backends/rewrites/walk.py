"""``rewrite_schema``: every rewrite applied to each node of a schema, its subschemas first (the
``definitions`` before the rest, so a ``$ref`` resolves to a rewritten target), and the names of
the rewrites (``REWRITES``). The rewrites themselves are in the sibling modules.
"""

from __future__ import annotations

import copy
from typing import Any

from guidespec.grammar_backends.interface import GrammarError
from guidespec.grammar_backends.rewrites.context import RewriteContext
from guidespec.grammar_backends.rewrites.finite import bounded_integers, finite_values
from guidespec.grammar_backends.rewrites.formats import unknown_format
from guidespec.grammar_backends.rewrites.logic import double_negation, if_then_else, not_keyword, not_type, one_of
from guidespec.grammar_backends.rewrites.nothing_matches import nothing_matches
from guidespec.grammar_backends.rewrites.objects import counted_properties, dependencies
from guidespec.grammar_backends.rewrites.refs import ref_siblings


_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
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
    context = RewriteContext(copy.deepcopy(schema), [], disabled)
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


def _walk(node: Any, context: RewriteContext, skip: tuple[str, ...] = ()) -> Any:
    if not isinstance(node, dict):
        return node
    node = double_negation(node, context)  # before the inner "not" is rewritten on its own
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
    node = not_keyword(dependencies(not_type(node, context), context), context, as_written.get("not"))
    if isinstance(node, dict):
        node = if_then_else(node, context, as_written.get("if"))
    for rewrite in (one_of, unknown_format, ref_siblings, bounded_integers, counted_properties):
        if isinstance(node, dict):
            node = rewrite(node, context)
    if isinstance(node, dict):
        node = finite_values(node, context)
    return nothing_matches(node, context) if isinstance(node, dict) else node
