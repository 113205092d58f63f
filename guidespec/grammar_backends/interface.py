"""The grammar interface: compile, make a matcher, accept, fill a bitmask row, roll back,
forced tokens, termination. Bitmasks are laid out as ``guidespec/bitmask.py`` says."""

from __future__ import annotations

import re
from typing import Any, Hashable, Protocol, Sequence

import numpy as np

from guidespec.protocol import GRAMMAR_BACKENDS, GuidedDecoding


class GrammarError(ValueError):
    """The backend refused a grammar; the message is the backend's own."""


class GrammarMatcher(Protocol):
    def accept_token(self, token: int) -> bool:
        """Advance by one token; False (and no change) if the grammar rejects it."""

    def advance(self, tokens: Sequence[int]) -> int:
        """Accept the longest prefix of ``tokens`` the grammar allows, stopping once it has
        terminated; how many were accepted (one call: the backend's loop, not Python's)."""

    def rollback(self, num_tokens: int) -> None: ...

    def is_terminated(self) -> bool:
        """The grammar has accepted a stop token: generation must end."""

    def forced_tokens(self, limit: int) -> list[int]:
        """Tokens the grammar allows alone from here, without accepting them (jump-forward)."""

    def error(self) -> str:
        """Why the matcher failed (a backend's resource limit), or empty: a failed matcher
        rejects every token from then on."""

    def can_end(self, stop_token: int) -> bool:
        """Whether the grammar would accept ``stop_token`` now (its output is complete), the
        matcher left as it was."""

    def state_key(self) -> Hashable | None:
        """Where the grammar stands, as a key two matchers share only if their next masks are
        equal (one fill then serves both), or None where the backend cannot tell."""


class GrammarBackend(Protocol):
    name: str
    vocab_size: int
    matchers_fail: bool  # whether a matcher of this backend can fail (``GrammarMatcher.error``)

    def compile(self, guided: GuidedDecoding) -> Any:
        """A compiled grammar (thread-safe, shareable); raises GrammarError."""

    def text_cost_s(self, compiled: Any) -> float | None:
        """About how long ``compiled``'s text takes to write and read back, or None where the text
        is cheap whatever the grammar (the scheduler compiles a grammar again itself where that
        is cheaper than its text: ``GrammarSettings.recompile``)."""

    def serialize(self, compiled: Any) -> str:
        """Text form of a compiled grammar, to carry it out of the compile process."""

    def deserialize(self, text: str) -> Any: ...

    def create_matcher(self, compiled: Any) -> GrammarMatcher: ...

    def fill_bitmasks(
        self, matchers: Sequence[GrammarMatcher], bitmask: np.ndarray, rows: Sequence[int], fresh: bool = False
    ) -> None:
        """Fill ``bitmask[rows[i]]`` for ``matchers[i]``, batched (and multi-threaded where the backend can).
        ``fresh``: each row from its matcher itself, none from a row the backend kept for a state."""


DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values in a JSON schema, not schemas


def find_counted_open_object(schema: Any) -> bool:
    """Whether a JSON schema bounds ``minProperties`` of an object open to names it does not list
    (``patternProperties``, or ``additionalProperties`` other than false). Neither backend keeps a
    name from repeating in such an object (``{"a": 1, "a": 2}``), and a repeated name counts
    twice for them, once for the schema: both refuse such schemas (sweep, Handwritten dep6).
    ``minProperties: 1`` is safe: an object with a name, repeated or not, has at least one."""
    if isinstance(schema, list):
        return any(find_counted_open_object(item) for item in schema)
    if not isinstance(schema, dict):
        return False
    counted = schema.get("minProperties", 0)
    if (not isinstance(counted, (int, float)) or counted > 1) and (
        "patternProperties" in schema or schema.get("additionalProperties") not in (None, False)
    ):
        return True
    return any(find_counted_open_object(v) for k, v in schema.items() if k not in DATA_KEYWORDS)


COUNTED_OPEN_OBJECT = (
    "cannot enforce 'minProperties' on an object open to more names in this json_schema (a name may repeat)"
)


def is_refusal(error: str) -> bool:
    """A backend's refusal of a grammar it cannot enforce exactly (another backend may), as
    opposed to a grammar that is wrong for any backend or a compile that ran out of time."""
    return error.startswith(tuple(f"{name} cannot" for name in GRAMMAR_BACKENDS))


def refusals_in(message: str) -> list[tuple[str, str]]:
    """(backend, keyword) of every refusal in an error message ("a; b" when both refused)."""
    parts = message.split(": ", 1)[1] if message.startswith("no grammar backend") else message
    return [(part.split(" ", 1)[0], refusal_keyword(part)) for part in parts.split("; ") if is_refusal(part)]


_KEYWORDS = {
    "not",
    "oneOf",
    "anyOf",
    "allOf",
    "if",
    "then",
    "else",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "format",
    "$ref",
    "pattern",
    "minLength",
    "maxLength",
    "minProperties",
    "maxProperties",
    "propertyNames",
    "multipleOf",
    "patternProperties",
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "prefixItems",
    "minItems",
    "maxItems",
    "const",
    "enum",
}


def refusal_keyword(error: str) -> str:
    """The JSON Schema keyword a refusal names ('not', 'uniqueItems'), for metrics: the first
    quoted one, else the first named one, else "other"."""
    quoted = re.findall(r"""['"`]([A-Za-z$][A-Za-z0-9_$]*)['"`]""", error)
    for word in quoted:
        if word in _KEYWORDS:
            return word
    named = re.search(
        r"(?<![\w$])(" + "|".join(re.escape(k) for k in sorted(_KEYWORDS, key=len, reverse=True)) + r")(?![\w$])", error
    )
    return named.group(1) if named else "other"
