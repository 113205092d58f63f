"""Nodes that no value matches, as ``false``: a node holding a part that matches nothing where
that makes the whole match nothing, and ``anyOf`` / ``oneOf`` without their ``false`` branches.
"""

from __future__ import annotations

from typing import Any

from guidespec.grammar_backends.rewrites.context import RewriteContext


def nothing_matches(node: dict[str, Any], context: RewriteContext) -> Any:
    """``false`` for a node that no value can match because a part of it matches nothing (see
    "Nothing matches" in the package's docstring); the node without its ``false`` branches of
    ``anyOf`` / ``oneOf``."""
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
