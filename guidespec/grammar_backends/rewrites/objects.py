"""Rewrites of an object's counted or dependent properties: ``dependencies`` /
``dependentRequired`` / ``dependentSchemas`` as an ``anyOf`` per name, and ``minProperties`` /
``maxProperties`` of a closed object as an ``anyOf`` of which optional names are present.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

from guidespec.grammar_backends.negation import any_of, conjoin
from guidespec.grammar_backends.rewrites.context import RewriteContext


def dependencies(node: dict[str, Any], context: RewriteContext) -> dict[str, Any]:
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


_MAX_SUBSETS = 64


def counted_properties(node: dict[str, Any], context: RewriteContext) -> Any:
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
