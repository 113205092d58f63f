"""The keywords beside a ``$ref``: annotations go, keywords its target repeats go, and from
draft 2019-09 on the rest become an ``allOf`` with the reference (drafts up to 7 ignore them).
"""

from __future__ import annotations

from typing import Any

from guidespec.grammar_backends.negation import VALIDATION
from guidespec.grammar_backends.rewrites.context import RewriteContext


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


def ref_siblings(node: dict[str, Any], context: RewriteContext) -> dict[str, Any]:
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
