"""xgrammar behind the grammar interface. JSON has fixed separators, ", " and ": ", and no other whitespace (no free
whitespace: a small model that may emit whitespace forever cannot then run out of tokens inside a value); fills use
xgrammar's multi-threaded ``BatchGrammarMatcher``."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
import threading
from collections import deque
from typing import Any, Callable, Hashable, Sequence

import numpy as np
import torch
import xgrammar as xgr

from guidespec.grammar_backends.tables import tokenizer_tables
from guidespec.grammar_backends.interface import (
    COUNTED_OPEN_OBJECT,
    DATA_KEYWORDS,
    GrammarError,
    GrammarMatcher,
    find_counted_open_object,
)
from guidespec.model_files import text_encoder
from guidespec.protocol import GuidedDecoding


logger = logging.getLogger(__name__)

# writing a compiled grammar as JSON and reading it back, per MB of its memory (its token-mask
# cache): 0.12-0.41 s on a Zen 3 core over JSONSchemaBench schemas and a 20000-value enum (105 MB
# of text: 8.2 s to write, 5.7 s to read, against 4.6 s to compile); the low end, so a grammar
# keeps its text where that may be the cheaper way
_TEXT_S_PER_MB = 0.12


_UNKNOWN = object()
# a grammar's known moves between keyed states (``XGrammarMatcher.state_key``): at most this many
# (each holds a key's debug text, a few hundred bytes: ~1-2 MB at most a grammar), then forgotten
# and learnt again; and how many keys back a matcher keeps for its rollbacks
_MAX_MOVES, _KEYS_KEPT = 4096, 16
# a grammar's keyed states' mask rows kept (``XGrammarBackend.fill_bitmasks``): at most this many
# bytes of them (170 rows at SmolLM2's 49k tokens, 32 at Gemma 3's 262k: a regex's or a choice's
# states in use are mostly a few), then forgotten; 256 MB at most over the compile cache's 256
_KEPT_ROW_BYTES = 1 << 20
# tokens a matcher lets wait for xgrammar at most (``XGrammarMatcher._pending``; 8 bytes each):
# past them each accept has xgrammar take the oldest, one accept a token as without waiting. (It
# took all 256 at once before: 64 rows of one regex begun together, 64 x 256 accepts of ~1.2 µs,
# ~20 ms in one step.)
_MAX_PENDING = 4096
# a kept row is checked against the matcher's own fill at each of its grammar's first
# _ROW_CHECKS uses and one in _ROW_CHECK_EVERY after
_ROW_CHECKS, _ROW_CHECK_EVERY = 16, 512


def _shared(compiled: Any, name: str) -> dict[Any, Any]:
    """A table the matchers of ``compiled`` share, kept on it (each matcher its own where it takes
    no attribute)."""
    table = getattr(compiled, name, None)
    if table is None:
        table = {}
        try:
            setattr(compiled, name, table)
        except AttributeError:
            pass
    return table  # type: ignore[no-any-return]


class XGrammarMatcher:
    """xgrammar's matcher, which a token moving it between keyed states by a move the grammar
    already knows does not reach until it is read: the token waits in ``_pending``, and
    :meth:`synced` gives it the waiting tokens first. A regex's or a choice's rows stand in few
    states, and a step fills one row of each (``GrammarManager._fill_rows``): the other rows'
    matchers are never read, and their accepts (xgrammar's, ~1.2 µs each) are not made."""

    def __init__(self, matcher: xgr.GrammarMatcher, encode: Callable[[str], list[int]], compiled: Any) -> None:
        self.matcher = matcher
        self._encode = encode
        self.compiled = compiled  # held: its id stays this grammar's while the matcher lives (state_key)
        self._key: Any = _UNKNOWN  # state_key's, until the grammar moves
        self._moved: tuple[Any, int] | None = None  # (key, token): the move since the key was known
        self._before: list[Any] = []  # the keys before the last accepts (a rollback's), newest last
        self._pending: deque[int] = deque()  # tokens accepted by known moves that ``matcher`` has not taken yet
        # is_terminated's answer until the grammar moves: a step asks it of a guided row three times
        # or more (the emit's advance, the fill, the end check), and xgrammar's costs ~0.6 µs
        self._ended: bool | None = None
        # the grammar's matchers learn its keyed states' moves ((key, token) -> key: never into a
        # terminated state) and forced tokens together
        self._moves: dict[tuple[Any, int], Any] = _shared(compiled, "_guidespec_moves")
        self._forced: dict[Any, list[int]] = _shared(compiled, "_guidespec_forced")
        # and the mask rows their fills gave (``kept_row``; "uses" counts the rows they served)
        self._rows: dict[Any, Any] = _shared(compiled, "_guidespec_rows")

    def synced(self) -> xgr.GrammarMatcher:
        """xgrammar's matcher, where this one stands: given the tokens its known moves took."""
        pending = self._pending
        if pending:
            for token in pending:
                self._take(token)
            pending.clear()
        return self.matcher

    def _take(self, token: int) -> None:
        """xgrammar's matcher takes a waiting token."""
        if not self.matcher.accept_token(token):  # (a known move is the grammar's: never)
            raise RuntimeError(f"xgrammar refused token {token} of a move it had made before")

    def accept_token(self, token: int) -> bool:
        key, after = self._key, _UNKNOWN
        before = self._before
        if key is not _UNKNOWN and key is not None:
            after = self._moves.get((key, token), _UNKNOWN)
            if after is not _UNKNOWN and after is not None and not self.is_terminated():
                before.append(key)  # a move the grammar knows: its next key, no accept yet
                if len(before) > _KEYS_KEPT:
                    del before[0]
                self._key, self._moved, self._ended = after, None, False
                pending = self._pending
                pending.append(token)
                if len(pending) > _MAX_PENDING:
                    self._take(pending.popleft())
                return True
        if not self.synced().accept_token(token):
            return False  # (a rejected token leaves the grammar, and its key, as they were)
        self._ended = None
        if key is _UNKNOWN:  # (a rollback past this token finds no key: none is kept for it, nor before it)
            if before:
                before.clear()
            self._moved = None
            return True
        before.append(key)
        if len(before) > _KEYS_KEPT:
            del before[0]
        if key is None:
            self._key, self._moved = _UNKNOWN, None
        else:  # a keyed state's move by a token is the grammar's, whichever matcher makes it
            self._key = after  # (known: a move into an unkeyed state)
            self._moved = (key, token) if after is _UNKNOWN else None
        return True

    def advance(self, tokens: Sequence[int]) -> int:
        matcher = self.synced()
        self._key, self._moved, self._ended = _UNKNOWN, None, None
        self._before.clear()
        count = 0
        for token in tokens:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            count += 1
        return count

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            before = self._before
            self._key = before[-num_tokens] if num_tokens <= len(before) else _UNKNOWN  # (where it was)
            del before[max(0, len(before) - num_tokens) :]
            self._moved = None
            pending = self._pending
            waiting = min(num_tokens, len(pending))  # (tokens xgrammar never took: dropped)
            for _ in range(waiting):
                pending.pop()
            if num_tokens > waiting:
                self.matcher.rollback(num_tokens - waiting)
            # (a state a known move reached, or left for one, is not terminated)
            self._ended = False if pending else None

    def is_terminated(self) -> bool:
        ended = self._ended
        if ended is None:
            ended = self._ended = bool(self.synced().is_terminated())
        return ended

    def error(self) -> str:
        return ""  # xgrammar's matchers do not fail: a rejected token leaves them as they were

    def can_end(self, stop_token: int) -> bool:
        """xgrammar takes one of its stop tokens (the engine's: ``tables``) exactly where the input
        is complete: ``is_completed``, 0.4 µs, where a trial accept of the stop token cost what an
        accept does (12 µs at the 200th item of a JSON array with ``minItems: 300``, before such
        arrays were written as prefix items: ``_counted_items_as_prefix``) and a rollback
        (test_can_end.py). A keyed state's key holds the answer."""
        if self.is_terminated():
            return False
        key = self._key
        if key is not _UNKNOWN and key is not None:
            return bool(key[1])
        return bool(self.synced().is_completed())

    def state_key(self) -> Hashable | None:
        """Equal for two matchers of one compiled grammar whose next masks are equal, or None.

        The key is where xgrammar's Earley parser stands: its last step's states (printed by its
        debug call, 1-2 µs) and whether the input so far is a whole match (the stop token's bit).
        A finished rule goes back to its parents through the step it started at: only states
        whose rules began at the root (-1) or at the first step (0: the same for every matcher
        of the grammar) make a key; a rule begun later might return to parents that differ.
        Without ``is_completed`` the keys would merge ``[a-z]+`` before and after its first
        letter (test_xgrammar_state_key.py). The debug text is not an API (an xgrammar without
        it gives no keys): the fill that shares keys checks some shared rows against their own
        fill and stops sharing if one differs (``GrammarManager._check_shared``). Kept until the
        grammar moves: a step's end check and its fill ask for it in turn.

        A keyed state is all of the parser's state that its future depends on (the rest, step 0,
        is every matcher's), so a token moves it to the same next state whichever matcher takes
        it: the grammar's matchers share the moves they have seen (``_moves``), and a matcher that
        moves by a known one knows its next key without the debug text, and without xgrammar's
        accept until it is read (``synced``). A move into a terminated state is not kept: its key
        may be the state's before the stop token."""
        if self._key is _UNKNOWN:
            matcher = self.synced()
            self._key = None
            debug_text = getattr(matcher, "_debug_print_internal_state", None)
            text = debug_text() if debug_text is not None else ""
            at = text.find("Last step")
            last = text[at:]
            states = last.count("rule_start_pos=")
            if at >= 0 and states and states == last.count("rule_start_pos=-1,") + last.count("rule_start_pos=0,"):
                self._key = (id(self.compiled), bool(matcher.is_completed()), last)
            if self._moved is not None:
                if not self.is_terminated():
                    if len(self._moves) >= _MAX_MOVES:
                        self._moves.clear()
                    self._moves[self._moved] = self._key
                self._moved = None
        return self._key  # type: ignore[no-any-return]

    def kept_row(self) -> np.ndarray | None:
        """The mask row a fill of this grammar gave in the keyed state this matcher stands in
        (``keep_row``), or None: a keyed state's mask is the state's, whichever matcher is there."""
        key = self._key
        if key is _UNKNOWN or key is None:
            return None
        return self._rows.get(key)  # type: ignore[no-any-return]

    def keep_row(self, row: np.ndarray) -> None:
        """Keep ``row``, this matcher's fill, for its keyed state (if it stands in one)."""
        key, rows = self._key, self._rows
        if key is _UNKNOWN or key is None or "off" in rows:
            return
        if (len(rows) + 1) * row.nbytes > _KEPT_ROW_BYTES:
            uses = rows.get("uses", 0)
            rows.clear()
            rows["uses"] = uses
        rows[key] = row.copy()

    def keep_no_rows(self) -> None:
        """The grammar keeps no rows from now on (a kept one was found wrong)."""
        self._rows.clear()
        self._rows["off"] = True

    def row_uses(self) -> int:
        """A kept row's use, counted across the grammar's matchers: how many came before it."""
        rows = self._rows
        uses = rows.get("uses", 0)
        rows["uses"] = uses + 1
        return uses  # type: ignore[no-any-return]

    def forced_tokens(self, limit: int) -> list[int]:
        """The jump-forward string, tokenized, less its last token (which the model might extend
        into a longer one), cut where the grammar stops accepting; the matcher is left unchanged.
        A keyed state's are the grammar's: found once, kept with its moves."""
        key = self._key
        if key is _UNKNOWN or key is None:
            return self._forced_tokens(limit)
        forced = self._forced.get(key)
        if forced is None:
            if len(self._forced) >= _MAX_MOVES:
                self._forced.clear()
            forced = self._forced[key] = self._forced_tokens(None)
        return forced[:limit]

    def _forced_tokens(self, limit: int | None) -> list[int]:
        matcher = self.synced()
        text = matcher.find_jump_forward_string()
        if not text:
            return []
        forced: list[int] = []
        for token in self._encode(text)[:-1][:limit]:
            if not matcher.accept_token(token):
                break
            forced.append(token)
        if forced:  # (xgrammar's own rollback: the state, and so its key and end, are as they were)
            matcher.rollback(len(forced))
        return forced


class XGrammarBackend:
    name = "xgrammar"
    matchers_fail = False  # (a rejected token leaves a matcher as it was)

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], num_threads: int) -> None:
        self.vocab_size = vocab_size
        self._encode = text_encoder(tokenizer)
        self.info = self.tables(tokenizer, vocab_size, stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=num_threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=num_threads)

    @staticmethod
    def tables(tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], keep: bool = False) -> Any:
        """The vocabulary's ``TokenizerInfo``, once per tokenizer (``tokenizer_tables``)."""
        return tokenizer_tables(
            "xgrammar",
            tokenizer,
            vocab_size,
            stop_token_ids,
            lambda: xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
            ),
            keep,
        )

    def compile(self, guided: GuidedDecoding) -> Any:
        kind = guided.kind
        try:
            if kind == "json_schema":
                original = json.loads(guided.json_schema)  # type: ignore[arg-type]
                _refuse_ignored_keywords(original)
                if find_counted_open_object(original):
                    raise GrammarError(f"xgrammar {COUNTED_OPEN_OBJECT}")
                schema = _declare_required(_distribute_siblings(original, original))
                schema = _counted_items_as_prefix(_rewrite_patterns(_drop_false_properties(schema)))
                text = json.dumps(schema)
                if '"oneOf"' not in text:  # the one approximation xgrammar makes (and logs)
                    return self.compiler.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "))
                # xgrammar reports it only as a C++ log line on file descriptor 2, which is the
                # process's: one capture at a time, or a line lands in another thread's capture
                with _STDERR_CAPTURE, _CapturedStderr() as log:
                    compiled = self.compiler.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "))
                lines = log.lines()
                approximation = next((line for line in lines if "cannot be represented exactly" in line), None)
                others = [line for line in lines if line is not approximation]
                if others:  # other threads' output, written while fd 2 was captured
                    print("\n".join(others), file=sys.stderr)
                if approximation is not None and not _one_ofs_disjoint_by_type(json.loads(guided.json_schema)):  # type: ignore[arg-type]
                    raise GrammarError(
                        "xgrammar cannot enforce this json_schema exactly (outputs could violate it): "
                        + approximation.split("Warning: ", 1)[-1]
                    )
                return compiled
            if kind == "json_object":
                return self.compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, separators=(", ", ": ")
                )
            if kind == "regex":
                return self.compiler.compile_regex(optional_groups_as_alternations(guided.regex))  # type: ignore[arg-type]
            if kind == "grammar":
                return self.compiler.compile_grammar(guided.grammar)  # type: ignore[arg-type]
            return self.compiler.compile_grammar(_choice_ebnf(guided.choice or ()))
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses with its message
            raise GrammarError(f"xgrammar cannot compile this {kind}: {e}") from None

    def text_cost_s(self, compiled: Any) -> float | None:
        return float(compiled.memory_size_bytes) / 1e6 * _TEXT_S_PER_MB

    def serialize(self, compiled: Any) -> str:
        return str(compiled.serialize_json())

    def deserialize(self, text: str) -> Any:
        return xgr.CompiledGrammar.deserialize_json(text, self.info)

    def create_matcher(self, compiled: Any) -> GrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled), self._encode, compiled)

    def fill_bitmasks(
        self, matchers: Sequence[GrammarMatcher], bitmask: np.ndarray, rows: Sequence[int], fresh: bool = False
    ) -> None:
        """A matcher in a keyed state whose row a fill gave before gets that row (``kept_row``):
        a regex's or a choice's rows stand in few states, and xgrammar's fill of one (and the
        waiting tokens it takes first) cost its scheduler ~0.13 ms a step at 64 rows of
        ``[0-9a-z ]+``, against a copy of the row (63 copies: 16 µs alone). Now and then a kept
        row is checked against the matcher's own fill; where they differ, the grammar keeps none
        again. ``fresh``: every row the matcher's own fill (the manager's checks of shared rows)."""
        fill: list[Any] = []  # (XGrammarMatcher's, or what stands in for one)
        at: list[int] = []
        for m, row in zip(matchers, rows):
            kept = None if fresh else m.kept_row()  # type: ignore[attr-defined]
            if kept is None:
                fill.append(m)
                at.append(row)
            elif self._checked(m, kept, bitmask, row):
                bitmask[row] = kept
        if fill:
            self.batch.batch_fill_next_token_bitmask([m.synced() for m in fill], torch.from_numpy(bitmask), at)
            for m, row in zip(fill, at):
                m.keep_row(bitmask[row])

    def _checked(self, matcher: Any, kept: np.ndarray, bitmask: np.ndarray, row: int) -> bool:
        """Whether ``kept`` may serve ``matcher``'s row: unchecked mostly; at a check, the matcher's
        own fill is written to ``bitmask[row]`` and compared (False: it is there, and the grammar
        keeps no rows from now on)."""
        uses = matcher.row_uses()
        if uses >= _ROW_CHECKS and uses % _ROW_CHECK_EVERY:
            return True
        self.batch.batch_fill_next_token_bitmask([matcher.synced()], torch.from_numpy(bitmask), [row])
        if np.array_equal(bitmask[row], kept):
            return True
        logger.error("xgrammar: a state's kept mask row differs from a fill in that state; its grammar keeps none")
        matcher.keep_no_rows()
        return False


# keywords xgrammar compiles without enforcing them (an invalid instance of each is accepted:
# tests/grammar_backends/test_exactness.py); the sweep found outputs breaking "not", "if",
# "dependencies" and a "$ref" beside "type" (Handwritten pNameFalse, key5, dep6, num2)
_IGNORED_KEYWORDS = (
    "not",
    "if",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "contains",
    "minContains",
    "maxContains",
)


def _refuse_ignored_keywords(schema: Any) -> None:
    """Raise GrammarError where xgrammar would compile a schema without enforcing part of it:
    the keywords above, ``uniqueItems: true``, keywords beside a ``$ref`` (xgrammar follows the
    reference and drops them). ``minProperties`` on an open object: ``find_counted_open_object``."""
    if isinstance(schema, list):
        for item in schema:
            _refuse_ignored_keywords(item)
        return
    if not isinstance(schema, dict):
        return
    for key in _IGNORED_KEYWORDS:
        if key in schema:
            raise GrammarError(f"xgrammar cannot enforce {key!r} in this json_schema (it would ignore it)")
    if schema.get("uniqueItems") is True:
        raise GrammarError("xgrammar cannot enforce 'uniqueItems' in this json_schema (it would ignore it)")
    if "multipleOf" in schema and schema.get("type") != "integer":  # it enforces it on integers only (o17460)
        raise GrammarError(
            "xgrammar cannot enforce 'multipleOf' on a non-integer in this json_schema (it would ignore it)"
        )
    if "pattern" in schema:  # it compiles the pattern and drops the lengths (sampled sweep, Snowplow sp_332)
        for key in ("minLength", "maxLength"):
            if key in schema:
                raise GrammarError(
                    f"xgrammar cannot enforce {key!r} beside a 'pattern' in this json_schema (it would ignore it)"
                )
    if "$ref" in schema:
        beside = sorted(k for k in schema if k != "$ref" and k not in _ANNOTATIONS)
        if beside:
            raise GrammarError(
                f"xgrammar cannot enforce the keywords beside a '$ref' in this json_schema "
                f"({', '.join(beside)}: it would ignore them)"
            )
    for key, value in schema.items():
        if key in DATA_KEYWORDS:
            continue
        if key in ("properties", "patternProperties", "definitions", "$defs") and isinstance(value, dict):
            for sub in value.values():  # names are data; their values are schemas
                _refuse_ignored_keywords(sub)
        else:
            _refuse_ignored_keywords(value)


def optional_groups_as_alternations(pattern: str) -> str:
    """``(X)?`` and ``(X){0,1}`` written as ``(X|)``, the same language. xgrammar compiles an
    optional group wrongly when X has a repeated part followed by a part that can be empty:
    ``^/(a+b*)?$`` accepted ``/b``, and the URI-path pattern of Github_hard o21410 accepted
    ``//x`` (sweep); the alternation form compiles right (tested against Python's ``re`` on
    random patterns). Escapes and character classes are left alone; ``)??`` and ``)?+`` too."""
    out = list(pattern)
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 1 + pattern.startswith("^", i + 1)
            i += pattern.startswith("]", i)  # a leading "]" is a member, not the end
            continue
        elif c == ")" and pattern.startswith("?", i + 1) and not pattern.startswith(("??", "?+"), i + 1):
            out[i], out[i + 1] = "|)", ""
        elif c == ")" and pattern.startswith("{0,1}", i + 1):
            out[i] = "|)"
            out[i + 1 : i + 6] = [""] * 5
        i += 1
    return "".join(out)


def _rewrite_patterns(schema: Any) -> Any:
    """The schema with every ``pattern`` and ``patternProperties`` key passed through
    ``optional_groups_as_alternations``."""

    def rewrite(node: dict[str, Any]) -> dict[str, Any]:
        if isinstance(node.get("pattern"), str):
            node["pattern"] = optional_groups_as_alternations(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {
                optional_groups_as_alternations(k): v for k, v in node["patternProperties"].items()
            }
        return node

    return _bottom_up(schema, rewrite)


def _bottom_up(schema: Any, rewrite: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """A copy of the schema with ``rewrite`` applied to every schema object in it, innermost
    first (values of ``const``/``enum``/... are data; so are the names of ``properties`` and the like)."""
    if isinstance(schema, list):
        return [_bottom_up(item, rewrite) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in DATA_KEYWORDS:
            out[key] = value
        elif key in ("properties", "patternProperties", "definitions", "$defs") and isinstance(value, dict):
            out[key] = {name: _bottom_up(sub, rewrite) for name, sub in value.items()}
        else:
            out[key] = _bottom_up(value, rewrite)
    return rewrite(out)


# xgrammar writes an array's ``minItems`` above 129, or ``maxItems`` above ~128, as a counted
# repetition whose accepts grow with the items written (its issue 805): an integer array with
# ``minItems: 300`` took 2 µs an accept in its first 100 tokens, 16 in tokens 600-800 and 19 past
# its 300th item, where the same array as ``prefixItems`` stays at 1.1 µs. Up to
# _PREFIX_ITEMS_MAX items such arrays are written as prefix items that all name one definition
# (compile: 13 ms at 300 items, 34 ms and 4.9 MB at 1,000 for an object of eight properties;
# inlined, the object's 300 copies took 320 ms). Past it the compile grows faster (4,000: 0.3 s,
# 67 MB) than the accepts it saves.
_COUNTED_ITEMS = 128
_PREFIX_ITEMS_MAX = 1024
_ITEM_DEFINITION = "guidespec-item-"


def _counted_items_as_prefix(schema: Any) -> Any:
    """The schema with each array whose ``minItems`` (or ``maxItems``) is above _COUNTED_ITEMS,
    up to _PREFIX_ITEMS_MAX, written with that many ``prefixItems``, each a ``$ref`` to its item
    schema (added to the root's ``$defs``). The same arrays: prefix items are optional, and each
    is the item schema; ``minItems`` stays, so the first ones are required; a ``maxItems`` written
    out as prefix items is ``items: false`` after them (not where a ``$ref`` could point into an
    array's ``items``). Arrays with ``contains``, ``additionalItems`` or ``unevaluatedItems``, or
    ``items`` as a list, are left alone; the definitions added never take a name the schema's
    ``$defs`` hold."""
    if not isinstance(schema, dict) or not isinstance(schema.get("$defs", {}), dict):
        return schema
    definitions: dict[str, tuple[str, Any]] = {}  # the item schema's text -> (its name, itself)
    taken = set(schema.get("$defs", {}))
    # a reference into an array's items (elsewhere in the schema) must still find them there
    items_referenced = any("/items" in ref for ref in _references(schema))

    def reference(items: Any) -> dict[str, Any]:
        if isinstance(items, dict) and set(items) == {"$ref"}:
            return dict(items)
        item = {} if items is True else items
        key = json.dumps(item, sort_keys=True)
        if key not in definitions:
            name = f"{_ITEM_DEFINITION}{len(definitions)}"
            while name in taken:  # (never one of the schema's own)
                name += "_"
            taken.add(name)
            definitions[key] = (name, item)
        return {"$ref": f"#/$defs/{definitions[key][0]}"}

    def rewrite(node: dict[str, Any]) -> dict[str, Any]:
        items, prefix = node.get("items", True), node.get("prefixItems", [])
        if (
            node.get("type") != "array"
            or not isinstance(items, (dict, bool))
            or items is False
            or not isinstance(prefix, list)
            or any(k in node for k in ("contains", "additionalItems", "unevaluatedItems"))
        ):
            return node
        low, high = (node.get(k) for k in ("minItems", "maxItems"))
        low = low if isinstance(low, int) and not isinstance(low, bool) else 0
        high = high if isinstance(high, int) and not isinstance(high, bool) else None
        if (
            high is not None
            and not items_referenced
            and low <= high
            and len(prefix) <= high
            and _COUNTED_ITEMS < high <= _PREFIX_ITEMS_MAX
        ):
            out = {k: v for k, v in node.items() if k != "maxItems"}
            out["prefixItems"] = prefix + [reference(items)] * (high - len(prefix))
            out["items"] = False
            return out
        if len(prefix) <= low and _COUNTED_ITEMS < low <= _PREFIX_ITEMS_MAX:
            # (``items`` written: after prefix items, xgrammar reads no ``items`` as none allowed)
            return {**node, "items": items, "prefixItems": prefix + [reference(items)] * (low - len(prefix))}
        return node

    out = _bottom_up(schema, rewrite)
    if definitions:
        out["$defs"] = {**out.get("$defs", {}), **dict(definitions.values())}
    return out


def _references(schema: Any) -> list[str]:
    """Every ``$ref`` in the schema (not in its data: ``enum`` values and the like)."""
    refs: list[str] = []

    def collect(node: dict[str, Any]) -> dict[str, Any]:
        if isinstance(node.get("$ref"), str):
            refs.append(node["$ref"])
        return node

    _bottom_up(schema, collect)
    return refs


_ANNOTATIONS = {
    "title",
    "description",
    "$schema",
    "$id",
    "id",
    "default",
    "examples",
    "$comment",
    "definitions",
    "$defs",
    "deprecated",
    "readOnly",
    "writeOnly",
}


def _distribute_siblings(schema: Any, root: Any) -> Any:
    """The schema with the keywords beside an ``anyOf`` / ``oneOf`` / ``allOf`` moved into its
    branches: xgrammar compiles only the composition and drops its siblings (a ``required`` next
    to an ``anyOf`` was not enforced: found by the sweep, Github_medium o22092). S and (B1 or B2)
    is (S and B1) or (S and B2), and exactly one of (S and Bi) holds iff S holds and exactly one
    Bi does, so the rewrite is exact; ``allOf`` branches are merged into one schema. A branch
    that contradicts its siblings' type can never match and is dropped; keywords that cannot be
    merged exactly are refused."""
    if isinstance(schema, list):
        return [_distribute_siblings(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _distribute_siblings(value, root) for key, value in schema.items()}
    compositions = [k for k in ("allOf", "anyOf", "oneOf") if isinstance(out.get(k), list)]
    if not compositions:
        return out
    kept = {k: v for k, v in out.items() if k in _ANNOTATIONS}
    siblings = {k: v for k, v in out.items() if k not in _ANNOTATIONS and k not in compositions}
    if "allOf" in compositions:
        for branch in out["allOf"]:
            merged = _merge(siblings, _inline_ref(branch, root))
            if merged is None:
                raise GrammarError("this json_schema's allOf contradicts itself: no value can match it")
            siblings = merged
        compositions.remove("allOf")
    if not compositions:
        merged = {**kept, **siblings}  # an allOf branch's anyOf/oneOf is now beside the rest: distribute it
        return _distribute_siblings(merged, root) if "anyOf" in merged or "oneOf" in merged else merged
    if len(compositions) == 2:  # anyOf and oneOf side by side: the second becomes a sibling of the first
        siblings = {**siblings, "oneOf": out["oneOf"]} if not siblings.get("oneOf") else siblings
        compositions = ["anyOf"]
    key = compositions[0]
    if not siblings:
        return {**kept, key: out[key]}
    branches = [_merge(siblings, _inline_ref(branch, root)) for branch in out[key]]
    branches = [b for b in branches if b is not None]
    if not branches:
        raise GrammarError(f"no branch of this json_schema's {key} fits the keywords beside it: no value can match")
    return {**kept, key: [_distribute_siblings(b, root) for b in branches]}


def _inline_ref(branch: Any, root: Any) -> Any:
    """A branch that is only a local ``$ref``, replaced by its target (one level)."""
    if isinstance(branch, dict) and set(branch) == {"$ref"} and str(branch["$ref"]).startswith("#/"):
        target: Any = root
        for part in str(branch["$ref"])[2:].split("/"):
            if not isinstance(target, dict) or part not in target:
                return branch
            target = target[part]
        return target
    return branch


def _merge(a: dict[str, Any], b: Any) -> dict[str, Any] | None:
    """The schema meaning ``a and b``, or None where they contradict (no value matches both);
    GrammarError where the two cannot be combined exactly here."""
    if b is True or b == {}:
        return dict(a)
    if b is False:
        return None
    if not isinstance(b, dict):
        raise GrammarError("xgrammar cannot combine this json_schema's composition with the keywords beside it")
    out = dict(a)
    for key, value in b.items():
        if key in _ANNOTATIONS or key not in out:
            out.setdefault(key, value)
        elif key == "required":
            out[key] = list(dict.fromkeys([*out[key], *value]))
        elif key == "properties":
            merged = dict(out[key])
            for name, sub in value.items():
                if name in merged and merged[name] != sub and not {_truth(merged[name]), _truth(sub)} - {None}:
                    raise GrammarError(f"xgrammar cannot combine two schemas of property {name!r} in a composition")
                # S and true is S; S and false is false
                merged[name] = (
                    merged[name]
                    if name in merged and (sub is True or sub == {})
                    else (False if merged.get(name) is False else sub)
                )
            out[key] = merged
        elif key == "type":
            ours = {out[key]} if isinstance(out[key], str) else set(out[key])
            theirs = {value} if isinstance(value, str) else set(value)
            if "number" in ours and "integer" in theirs:
                ours.add("integer")
            if "number" in theirs and "integer" in ours:
                theirs.add("integer")
            both = sorted(ours & theirs)
            if not both:
                return None
            out[key] = both[0] if len(both) == 1 else both
        elif out[key] != value:
            raise GrammarError(f"xgrammar cannot combine {key!r} of a composition with the {key!r} beside it")
    return None if _requires_forbidden(out) else out


def _truth(schema: Any) -> bool | None:
    """True for a schema every value matches (``true``, ``{}``), False for ``false``, else None."""
    return True if schema is True or schema == {} else False if schema is False else None


def _drop_false_properties(schema: Any) -> Any:
    """The schema without its ``properties: {name: false}``: xgrammar cannot compile ``false``
    ("cannot accept any value"), and its objects hold only the names they declare, so an
    undeclared name is absent, as ``false`` says. Refused where the name could still come from
    ``additionalProperties`` or a ``patternProperties`` pattern; left where it is required
    (then no object matches, and xgrammar says so)."""
    return _bottom_up(schema, _undeclare_false_properties)


def _undeclare_false_properties(out: dict[str, Any]) -> dict[str, Any]:
    properties = out.get("properties")
    if not isinstance(properties, dict):
        return out
    required: list[Any] = out["required"] if isinstance(out.get("required"), list) else []
    absent = [n for n, sub in properties.items() if sub is False and n not in required]
    if not absent:
        return out
    patterns: dict[str, Any] = out["patternProperties"] if isinstance(out.get("patternProperties"), dict) else {}
    if out.get("additionalProperties", False) is not False or any(_may_match(p, n) for p in patterns for n in absent):
        raise GrammarError(
            "xgrammar cannot forbid a property of an object open to more names in this json_schema "
            "('properties' false beside 'additionalProperties')"
        )
    out["properties"] = {n: sub for n, sub in properties.items() if n not in absent}
    return out


def _may_match(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return True  # a pattern Python cannot read: assume it matches


def _undeclared_required(schema: dict[str, Any]) -> dict[str, Any]:
    """Each ``required`` name that ``properties`` does not declare, with the schema its value may
    have: the first matching ``patternProperties`` schema (Github_medium o83151), else what
    ``additionalProperties`` allows (any value by default), else ``False`` (forbidden)."""
    required, properties = schema.get("required"), schema.get("properties", {})
    if not isinstance(required, list) or not isinstance(properties, dict):
        return {}
    patterns: dict[str, Any] = schema["patternProperties"] if isinstance(schema.get("patternProperties"), dict) else {}
    extra = schema.get("additionalProperties", True)
    out: dict[str, Any] = {}
    for name in required:
        if isinstance(name, str) and name not in properties:
            match = next((sub for pattern, sub in patterns.items() if re.search(pattern, name)), None)
            if match is None:
                match = extra if isinstance(extra, dict) else ({} if extra is not False else False)
            out[name] = match
    return out


def _requires_forbidden(schema: dict[str, Any]) -> bool:
    """True if the object schema requires a name that ``additionalProperties: false`` forbids."""
    return any(value is False for value in _undeclared_required(schema).values())


def _declare_required(schema: Any) -> Any:
    """The schema with every ``required`` name that ``properties`` leaves undeclared declared
    (``_undeclared_required``): xgrammar closes objects, and would otherwise drop the
    requirement. Refuses a requirement that ``additionalProperties: false`` makes impossible."""
    if isinstance(schema, list):
        return [_declare_required(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _declare_required(value) for key, value in schema.items()}
    declared = _undeclared_required(out)
    forbidden = next((name for name, value in declared.items() if value is False), None)
    if forbidden is not None:
        raise GrammarError(f"the schema requires {forbidden!r}, which additionalProperties: false forbids")
    if declared:
        out["properties"] = {**out.get("properties", {}), **declared}
    return out


def _one_ofs_disjoint_by_type(schema: Any) -> bool:
    """True if every ``oneOf`` in the schema has branches of distinct plain types (at most one of
    ``integer``/``number``): no value can match two branches, so anyOf semantics are exact.
    xgrammar cannot prove that much and warns; this check lets those schemas through."""
    if isinstance(schema, list):
        return all(_one_ofs_disjoint_by_type(item) for item in schema)
    if not isinstance(schema, dict):
        return True
    branches = schema.get("oneOf")
    if isinstance(branches, list):
        types = [b.get("type") if isinstance(b, dict) else None for b in branches]
        if not all(isinstance(t, str) for t in types) or len(set(types)) < len(types):
            return False
        if "integer" in types and "number" in types:
            return False
    return all(_one_ofs_disjoint_by_type(value) for value in schema.values())


_STDERR_CAPTURE = threading.Lock()


class _CapturedStderr:
    """Everything written to file descriptor 2 (C++ logs included) inside the ``with`` block."""

    def __enter__(self) -> "_CapturedStderr":
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile(mode="w+b")
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)

    def lines(self) -> list[str]:
        self.file.seek(0)
        text = self.file.read().decode(errors="replace")
        self.file.close()
        return text.splitlines()


def _choice_ebnf(choices: Sequence[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)
