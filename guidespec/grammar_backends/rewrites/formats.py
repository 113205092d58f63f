"""Unknown formats: a ``format`` no JSON Schema draft defines is an annotation, and is dropped."""

from __future__ import annotations

from typing import Any

from guidespec.grammar_backends.rewrites.context import RewriteContext


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


def unknown_format(node: dict[str, Any], context: RewriteContext) -> dict[str, Any]:
    value = node.get("format")
    if not isinstance(value, str) or value in _FORMATS:
        return node
    declared = context.root.get("$schema") if isinstance(context.root, dict) else None
    if value in _DRAFT_3_FORMATS and (not isinstance(declared, str) or "draft-03" in declared):
        return node
    if not context.use("unknown format"):
        return node
    return {k: v for k, v in node.items() if k != "format"}
