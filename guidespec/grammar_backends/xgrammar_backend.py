"""xgrammar behind the grammar interface. JSON has fixed separators, ", " and ": ", and no other whitespace (no free
whitespace: a small model that may emit whitespace forever cannot then run out of tokens inside a value); fills use
xgrammar's multi-threaded ``BatchGrammarMatcher``."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Callable, Sequence

import numpy as np
import torch
import xgrammar as xgr

from guidespec.grammar_backends.interface import GrammarError, GrammarMatcher
from guidespec.protocol import GuidedDecoding

_MAX_ROLLBACK = 64


class XGrammarMatcher:
    def __init__(self, matcher: xgr.GrammarMatcher, encode: Callable[[str], list[int]]) -> None:
        self.matcher = matcher
        self._encode = encode

    def accept_token(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def forced_tokens(self, limit: int) -> list[int]:
        """The jump-forward string, tokenized, less its last token (which the model might extend
        into a longer one), cut where the grammar stops accepting; the matcher is left unchanged."""
        text = self.matcher.find_jump_forward_string()
        if not text:
            return []
        forced: list[int] = []
        for token in self._encode(text)[:-1][:limit]:
            if not self.matcher.accept_token(token):
                break
            forced.append(token)
        self.rollback(len(forced))
        return forced


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], num_threads: int) -> None:
        self.vocab_size = vocab_size
        self._encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=num_threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=num_threads)

    def compile(self, spec: GuidedDecoding) -> Any:
        kind = spec.kind
        try:
            if kind == "json_schema":
                schema = _declare_required(json.loads(spec.json_schema))  # type: ignore[arg-type]
                with _CapturedStderr() as log:  # xgrammar reports approximations only as a C++ log line
                    compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                 separators=(", ", ": "))
                approximation = next((line for line in log.lines() if "cannot be represented exactly" in line), None)
                if approximation is not None and not _one_ofs_disjoint_by_type(json.loads(spec.json_schema)):  # type: ignore[arg-type]
                    raise GrammarError("xgrammar cannot enforce this json_schema exactly (outputs could violate it): "
                                       + approximation.split("Warning: ", 1)[-1])
                return compiled
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=(", ", ": "))
            if kind == "regex":
                return self.compiler.compile_regex(spec.regex)  # type: ignore[arg-type]
            if kind == "grammar":
                return self.compiler.compile_grammar(spec.grammar)  # type: ignore[arg-type]
            return self.compiler.compile_grammar(_choice_ebnf(spec.choice or ()))
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses with its message
            raise GrammarError(f"xgrammar cannot compile this {kind}: {e}") from None

    def serialize(self, compiled: Any) -> str:
        return str(compiled.serialize_json())

    def deserialize(self, text: str) -> Any:
        return xgr.CompiledGrammar.deserialize_json(text, self.info)

    def create_matcher(self, compiled: Any) -> GrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled, max_rollback_tokens=_MAX_ROLLBACK), self._encode)

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: np.ndarray, rows: Sequence[int]) -> None:
        inner = [m.matcher for m in matchers]  # type: ignore[attr-defined]
        self.batch.batch_fill_next_token_bitmask(inner, torch.from_numpy(bitmask), list(rows))


def _declare_required(schema: Any) -> Any:
    """The schema with every ``required`` name that ``properties`` leaves undeclared declared as
    ``additionalProperties`` allows it (any value by default): xgrammar closes objects, and would
    otherwise drop the requirement. Refuses a requirement that ``additionalProperties: false``
    makes impossible to meet."""
    if isinstance(schema, list):
        return [_declare_required(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _declare_required(value) for key, value in schema.items()}
    required, properties = out.get("required"), out.get("properties", {})
    if isinstance(required, list) and isinstance(properties, dict) and "patternProperties" not in out:
        missing = [name for name in required if isinstance(name, str) and name not in properties]
        extra = out.get("additionalProperties", True)
        if missing and extra is False:
            raise GrammarError(f"the schema requires {missing[0]!r}, which additionalProperties: false forbids")
        if missing:
            out["properties"] = {**properties, **{name: extra if isinstance(extra, dict) else {} for name in missing}}
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
