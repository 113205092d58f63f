r"""llguidance behind the grammar interface. Fills use llguidance's parallel executor
(``fill_next_token_bitmask_par``, GIL released); forced tokens come from its own
``compute_ff_tokens``. JSON is compact (no whitespace), as with xgrammar. Note: llguidance's
regex ``\d`` is Unicode-aware (any decimal digit), unlike xgrammar's."""

from __future__ import annotations

import json
from typing import Any, Sequence

import llguidance as llg
import llguidance.hf
import llguidance.numpy
import numpy as np

from guidespec.grammar_backends.interface import (
    COUNTED_OPEN_OBJECT,
    GrammarError,
    GrammarMatcher,
    find_counted_open_object,
)
from guidespec.protocol import GuidedDecoding


# Compact JSON, as with xgrammar: no free whitespace a small model could loop in.
_COMPACT_JSON: Any = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class LLGuidanceMatcher:
    def __init__(self, matcher: llg.LLMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token: int) -> bool:
        if self.matcher.validate_tokens([token]) != 1:
            return False
        return bool(self.matcher.consume_token(token))

    def advance(self, tokens: Sequence[int]) -> int:
        tokens = list(tokens)
        if not tokens or self.matcher.is_stopped():
            return 0
        count = self.matcher.validate_tokens(tokens)
        if count and not self.matcher.consume_tokens(tokens[:count]):
            return 0  # (a matcher in error: nothing it accepted stays)
        if count > 1 and self.matcher.is_stopped():  # it may have stopped before the last of them
            self.matcher.rollback(count)  # (and a token past that is not accepted one by one)
            count = 0
            while count < len(tokens) and not self.matcher.is_stopped() and self.accept_token(tokens[count]):
                count += 1
        return count

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())

    def forced_tokens(self, limit: int) -> list[int]:
        return list(self.matcher.compute_ff_tokens())[:limit]

    def error(self) -> str:
        return str(self.matcher.get_error()) if self.matcher.is_error() else ""


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], num_threads: int) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids) or None
        )
        self.executor = llg.LLExecutor(num_threads)

    def compile(self, spec: GuidedDecoding) -> Any:
        kind = spec.kind
        if kind == "json_schema" and find_counted_open_object(json.loads(spec.json_schema)):  # type: ignore[arg-type]
            raise GrammarError(f"llguidance {COUNTED_OPEN_OBJECT}")
        try:
            if kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(spec.json_schema, overrides=_COMPACT_JSON)  # type: ignore[arg-type]
            elif kind == "json_object":
                grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_COMPACT_JSON)
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(spec.regex)  # type: ignore[arg-type]
            elif kind == "grammar":
                grammar = llg.LLMatcher.grammar_from_lark(spec.grammar)  # type: ignore[arg-type]
            else:
                grammar = llg.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in spec.choice or ())
                )
        except Exception as e:
            raise GrammarError(f"llguidance cannot compile this {kind}: {e}") from None
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(f"llguidance cannot compile this {kind}: {error}")
        # Build once here, in the compile thread: it checks the grammar against the tokenizer
        # and warms llguidance's caches, so matchers made later start at once.
        probe = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if probe.is_error():
            raise GrammarError(f"llguidance cannot compile this {kind}: {probe.get_error()}")
        return grammar

    def text_cost_s(self, compiled: Any) -> float | None:
        return None  # its serialized grammar is the grammar's own small text

    def serialize(self, compiled: Any) -> str:
        return str(compiled)  # an llguidance grammar is already text

    def deserialize(self, text: str) -> Any:
        return text

    def create_matcher(self, compiled: Any) -> GrammarMatcher:
        return LLGuidanceMatcher(llg.LLMatcher(self.tokenizer, compiled, log_level=0))

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: np.ndarray, rows: Sequence[int]) -> None:
        pairs = [(m.matcher, row) for m, row in zip(matchers, rows)]  # type: ignore[attr-defined]
        llguidance.numpy.fill_next_token_bitmask_par(self.executor, pairs, bitmask)
