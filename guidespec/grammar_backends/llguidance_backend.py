r"""llguidance behind the grammar interface. Fills use llguidance's parallel executor
(``fill_next_token_bitmask_par``, GIL released); forced tokens come from its own
``compute_ff_tokens``. JSON is compact (no whitespace), as with xgrammar. Note: llguidance's
regex ``\d`` is Unicode-aware (any decimal digit), unlike xgrammar's.

A matcher that meets one of llguidance's limits mid-way (a lexer or parser that grows too
complex) stops in an error state: it then allows only EOS, as if it had finished. Here that
is never an end: ``is_terminated`` is a normal stop only, ``error`` says why it failed, and the
scheduler fails (or restarts) the request. ``parser_limits`` raises the limit issue 45's schema met (the lexer's fuel),
and ``compile`` walks a grammar's first lexemes to refuse one that gives up there anyway."""

from __future__ import annotations

import json
import time
from typing import Any, Sequence

import llguidance as llg
import llguidance.hf
import llguidance.numpy
import numpy as np

from guidespec import envs
from guidespec.bitmask import allowed_ids, bitmask_width
from guidespec.grammar_backends.tables import tokenizer_tables
from guidespec.grammar_backends.interface import (
    COUNTED_OPEN_OBJECT,
    GrammarError,
    GrammarMatcher,
    find_counted_open_object,
)
from guidespec.protocol import GuidedDecoding


# Compact JSON, as with xgrammar: no free whitespace a small model could loop in.
_COMPACT_JSON: Any = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


# llguidance's limits, as chosen here (its defaults otherwise). The lexer's fuel for one mask
# (default 200,000, ~14 ms) ran out on a string of a pattern and an anyOf of six more (issue 45:
# "too many expressions constructed" after the opening quote, which then read as a finished
# answer); 500,000 sufficed, 1,000,000 (``envs.llguidance_lexer_fuel``) leaves room. Only a
# grammar that needs the fuel spends it: at ~14,000 a millisecond, its own masks can take up to
# ~70 ms (that request's, and the step it shares with others); every other grammar's masks are
# unchanged. Errors are kept short (``verbose_errors``): a client sees the reason, not the
# parser's state and grammar.
def parser_limits() -> llg.LLParserLimits:
    return llg.LLParserLimits(step_lexer_fuel=envs.llguidance_lexer_fuel(), verbose_errors=False)


# a copy of the matcher where it was filled (``LLGuidanceMatcher._before_walk``) is kept while
# one costs less than this: the parser's state, and its copy, grow along a long array (an
# integer array's copy took 4.6 µs in its first 100 tokens, 73 µs at its 1,500th: every accept
# paid it), where a fill, which a rollback without the copy costs instead, stays at ~10 µs
_COPY_MAX_S = 10e-6

# the compile-time walk (``_walk_first_lexemes``): how many single-character tokens it tries at
# each state, how deep, and for how long at most
_PROBE_WIDTH, _PROBE_DEPTH, _PROBE_BUDGET_S = 6, 3, 0.5


class LLGuidanceMatcher:
    """An llguidance matcher whose masks stay right across rollbacks.

    llguidance (1.5.1 to at least 1.9.1) keeps the last mask it computed, keyed by the lexer's
    state and the parser's row index, and a rollback does not drop it. A state on a branch a
    rollback discarded can thus answer for a later state with the same key but other rows: after
    ``{"k":["`` was filled, rolled back by one token and followed by ``{"``, the mask still
    allows ``","`` (an array item's end, not a key's). Here a rollback past the last fill marks
    the cache stale, and the matcher refreshes it at the rollback's target (a fill there is
    right: same row index there means the same rows) before it walks on: the next fill does it
    at no cost if it comes first, else one fill into a scratch row before the next token.

    The usual walk needs no refresh: a copy of the matcher taken where it was last filled, as it
    walks on from there (``deep_copy``, microseconds), is what a rollback to there restores, its
    cache right. Closing's lookaheads try many tokens from one filled state, one fill each. Once a
    copy costs more than a fill (_COPY_MAX_S, twice in a row: a long array), the matcher keeps none: a rollback
    there refreshes instead, and a walk that is not rolled back costs no copy."""

    def __init__(self, matcher: llg.LLMatcher, width: int) -> None:
        self.matcher, self.width = matcher, width
        self.position = 0  # tokens consumed, net of rollbacks
        self._filled_at = -1  # the position of the last fill: the state llguidance's cache holds
        self._stale = False  # that state was rolled back: the cache must be refreshed before a walk
        self._scratch: np.ndarray | None = None
        self._saved: llg.LLMatcher | None = None  # a copy at ``_saved_at``, where it was last filled
        self._saved_at = -1
        self._copies = True  # whether walks keep that copy (until two in a row cost more than _COPY_MAX_S)
        self._slow_copy = False  # the last copy cost more than _COPY_MAX_S

    def accept_token(self, token: int) -> bool:
        """(A matcher in error still takes EOS: here it takes nothing.)"""
        matcher = self.matcher
        if matcher.is_error() or matcher.validate_tokens([token]) != 1:
            return False
        self._before_walk()
        matcher = self.matcher
        if not matcher.consume_token(token):
            return False
        self.position += 1
        return not matcher.is_error()

    def advance(self, tokens: Sequence[int]) -> int:
        tokens = list(tokens)
        if not tokens or self.matcher.is_stopped():
            return 0
        count = self.matcher.validate_tokens(tokens)
        if not count:
            return 0
        self._before_walk()
        if not self.matcher.consume_tokens(tokens[:count]):
            return 0  # (a matcher in error: it stays in error, whatever it took)
        self.position += count
        if count > 1 and self.matcher.is_stopped():  # it may have stopped before the last of them
            self.rollback(count)  # (and a token past that is not accepted one by one)
            count = 0
            while count < len(tokens) and not self.matcher.is_stopped() and self.accept_token(tokens[count]):
                count += 1
        return count

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        target = self.position - num_tokens
        # back where it was filled (a matcher in error stays so: the request fails, as it should)
        if self._saved is not None and target == self._saved_at and not self.matcher.is_error():
            self.matcher, self._saved = self._saved, None
            self.position = self._filled_at = target
            self._stale = False
            return
        self.matcher.rollback(num_tokens)
        self.position = target
        if self._saved_at > target:
            self._saved = None
        if self._filled_at > target:
            self._stale = True

    def filled(self) -> None:
        """A fill at the current state: llguidance's cache now holds it (and is right)."""
        self._filled_at, self._stale = self.position, False

    def _before_walk(self) -> None:
        """Before the matcher takes tokens: its cache made right, and a copy kept where it was
        filled (what a rollback to there restores)."""
        if self._stale:
            self._refresh()
        if (
            self._copies
            and self.position == self._filled_at
            and (self._saved is None or self._saved_at != self.position)
        ):
            start = time.perf_counter()
            self._saved, self._saved_at = self.matcher.deep_copy(), self.position
            slow = time.perf_counter() - start > _COPY_MAX_S
            self._copies = not (slow and self._slow_copy)  # (two in a row: not a preempted one)
            self._slow_copy = slow

    def _refresh(self) -> None:
        if self._scratch is None:
            self._scratch = np.zeros((1, self.width), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._scratch)
        self.filled()

    def is_terminated(self) -> bool:
        """A normal end (the grammar is complete, or took EOS); a matcher in error is not ended."""
        matcher = self.matcher
        return bool(matcher.is_stopped()) and not matcher.is_error()

    def forced_tokens(self, limit: int) -> list[int]:
        return list(self.matcher.compute_ff_tokens())[:limit]

    def error(self) -> str:
        return matcher_error(self.matcher)

    def can_end(self, stop_token: int) -> bool:
        """``is_accepting`` (its EOS is the engine's stop token: ``tables``), short of a stopped or
        failed matcher, which takes nothing: a trial accept of EOS and its rollback cost ~70 µs
        on a regex's row (the same walks agree: test_can_end.py)."""
        matcher = self.matcher
        return not matcher.is_error() and not matcher.is_stopped() and bool(matcher.is_accepting())

    def state_key(self) -> None:
        return None  # (llguidance keeps the mask of its lexer's state itself: above)


def matcher_error(matcher: llg.LLMatcher) -> str:
    """Why an llguidance matcher failed ("" if it did not): its stop reason and the first line
    of its message (the rest is its parser's state)."""
    if not matcher.is_error():
        return ""
    reason = str(matcher.stop_reason())
    message = str(matcher.get_error()).strip().splitlines()
    first = message[0] if message else "unknown error"
    return first if reason in ("InternalError", "NotStopped") else f"{reason}: {first}"


class LLGuidanceBackend:
    name = "llguidance"
    matchers_fail = True  # (a lexer's or parser's limit met mid-way)

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], num_threads: int) -> None:
        self.vocab_size = vocab_size
        # the tokenizer, and single-character tokens by character: what the compile-time walk tries
        self.tokenizer, self._chars = self.tables(tokenizer, vocab_size, stop_token_ids)
        self.executor = llg.LLExecutor(num_threads)
        self.limits = parser_limits()  # (read when the engine starts, not when a zygote imported this)

    @staticmethod
    def tables(
        tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], keep: bool = False
    ) -> tuple[Any, list[tuple[str, int]]]:
        """llguidance's tokenizer and the single-character tokens, once per tokenizer
        (``tokenizer_tables``)."""
        return tokenizer_tables(  # type: ignore[no-any-return]
            "llguidance",
            tokenizer,
            vocab_size,
            stop_token_ids,
            lambda: (
                _ll_tokenizer(tokenizer, vocab_size, list(stop_token_ids) or None),
                _single_char_tokens(tokenizer, vocab_size),
            ),
            keep,
        )

    def compile(self, guided: GuidedDecoding) -> Any:
        kind = guided.kind
        if kind == "json_schema" and find_counted_open_object(json.loads(guided.json_schema)):  # type: ignore[arg-type]
            raise GrammarError(f"llguidance {COUNTED_OPEN_OBJECT}")
        try:
            if kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(guided.json_schema, overrides=_COMPACT_JSON)  # type: ignore[arg-type]
            elif kind == "json_object":
                grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_COMPACT_JSON)
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(guided.regex)  # type: ignore[arg-type]
            elif kind == "grammar":
                grammar = llg.LLMatcher.grammar_from_lark(guided.grammar)  # type: ignore[arg-type]
            else:
                grammar = llg.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in guided.choice or ())
                )
        except Exception as e:
            raise GrammarError(f"llguidance cannot compile this {kind}: {e}") from None
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=self.limits)
        if error:
            raise GrammarError(f"llguidance cannot compile this {kind}: {error}")
        # Build once here, in the compile thread: it checks the grammar against the tokenizer
        # and warms llguidance's caches, so matchers made later start at once.
        probe = llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if probe.is_error():
            raise GrammarError(f"llguidance cannot compile this {kind}: {matcher_error(probe)}")
        gave_up = self._walk_first_lexemes(LLGuidanceMatcher(probe, bitmask_width(self.vocab_size)))
        if gave_up:
            raise GrammarError(f"llguidance cannot enforce this {kind}: it gives up {gave_up}")
        return grammar

    def _walk_first_lexemes(self, walker: LLGuidanceMatcher) -> str:
        """Where the grammar's matcher fails in its first few tokens, or "": a walk over the
        single-character tokens each state allows (a string's quote and first characters, a
        number's sign and digits, a bracket), ``_PROBE_WIDTH`` of them at each state,
        ``_PROBE_DEPTH`` deep, within ``_PROBE_BUDGET_S``. llguidance builds its lexer lazily,
        so a grammar too complex for its limits fails at the first mask after such a token: a
        failure there is found here, before a request meets it."""
        deadline = time.monotonic() + _PROBE_BUDGET_S
        width = bitmask_width(self.vocab_size)
        row = np.zeros((1, width), dtype=np.int32)

        def walk(path: list[str], depth: int) -> str:
            self.fill_bitmasks([walker], row, [0])
            if walker.error():
                where = "at the start" if not path else "after " + json.dumps("".join(path))
                return f"{where}: {walker.error()}"
            if depth == _PROBE_DEPTH or walker.matcher.is_stopped():
                return ""
            allowed = set(allowed_ids(row[0], self.vocab_size).tolist())
            tried = 0
            for char, token in self._chars:
                if tried == _PROBE_WIDTH or time.monotonic() > deadline:
                    break
                if token not in allowed:
                    continue
                tried += 1
                if not walker.accept_token(token):
                    reason = walker.error() or "it refused a token its mask allowed"
                    return f"after {json.dumps(''.join(path + [char]))}: {reason}"
                found = walk(path + [char], depth + 1)
                if found:
                    return found
                walker.rollback(1)
            return ""

        return walk([], 0)

    def text_cost_s(self, compiled: Any) -> float | None:
        return None  # its serialized grammar is the grammar's own small text

    def serialize(self, compiled: Any) -> str:
        return str(compiled)  # an llguidance grammar is already text

    def deserialize(self, text: str) -> Any:
        return text

    def create_matcher(self, compiled: Any) -> GrammarMatcher:
        return LLGuidanceMatcher(
            llg.LLMatcher(self.tokenizer, compiled, log_level=0, limits=self.limits), bitmask_width(self.vocab_size)
        )

    def fill_bitmasks(
        self, matchers: Sequence[GrammarMatcher], bitmask: np.ndarray, rows: Sequence[int], fresh: bool = False
    ) -> None:
        pairs = [(m.matcher, row) for m, row in zip(matchers, rows)]  # type: ignore[attr-defined]
        llguidance.numpy.fill_next_token_bitmask_par(self.executor, pairs, bitmask)
        for m in matchers:
            m.filled()  # type: ignore[attr-defined]


# the characters a walk tries first: those that open a JSON value or a string's usual text
_PROBE_ORDER = '"{[-0123456789tfnaAzZ_ .:/,}]'


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos: list[int] | None) -> Any:
    """``llguidance.hf.from_tokenizer``'s tokenizer without its copy of the Rust tokenizer (0.2 s
    of 0.77 for SmolLM2's, at each engine's start), which it makes only to turn padding and
    truncation off before serializing it: where both are already off, the tokenizer itself
    serializes to the same string."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.padding is not None or backend.truncation is not None:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    return llg.LLTokenizer(
        backend.to_str(), n_vocab=vocab_size, eos_token=eos if eos is not None else tokenizer.eos_token_id
    )


def _single_char_tokens(tokenizer: Any, vocab_size: int) -> list[tuple[str, int]]:
    """(character, token) for each printable ASCII character that is one token, in
    ``_PROBE_ORDER`` first, then the rest."""
    chars = list(dict.fromkeys(_PROBE_ORDER + "".join(chr(c) for c in range(33, 127))))
    out = []
    for char in chars:
        ids = tokenizer.encode(char, add_special_tokens=False)
        if len(ids) == 1 and 0 <= ids[0] < vocab_size:
            out.append((char, int(ids[0])))
    return out
