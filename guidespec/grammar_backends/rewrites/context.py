"""The state of one schema's rewriting (``RewriteContext``): the root schema, for its ``$ref``
targets and the draft it is read in; the names of the rewrites applied and why nodes match
nothing; a ``jsonschema`` validator in the root's draft. Also the keyword sets and the schema
search the rewrites share. It rewrites nothing itself.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import urllib.parse
from typing import Any

import jsonschema


TYPES = ("null", "boolean", "object", "array", "string", "number")
ANNOTATIONS = {
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


@dataclasses.dataclass
class RewriteContext:
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
        return contains(self.root, {"dependencies"})

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


def contains(node: Any, keywords: set[str]) -> bool:
    """Whether a schema holds one of ``keywords``, or ``items`` as a list (draft-dependent), anywhere."""
    if isinstance(node, dict):
        return (
            bool(keywords & set(node))
            or isinstance(node.get("items"), list)
            or any(contains(v, keywords) for v in node.values())
        )
    if isinstance(node, list):
        return any(contains(v, keywords) for v in node)
    return False


def _nested_ids(node: Any, top: bool) -> bool:
    if isinstance(node, list):
        return any(_nested_ids(v, False) for v in node)
    if not isinstance(node, dict):
        return False
    if not top and any(isinstance(node.get(k), str) and not str(node[k]).startswith("#") for k in ("$id", "id")):
        return True
    return any(_nested_ids(v, False) for k, v in node.items() if k not in ANNOTATIONS and k not in ("enum", "const"))
