"""Grammar backends behind one small interface (``interface.py``): xgrammar and llguidance.

The scheduler owns every grammar: it compiles them (in its compile process), keeps one matcher
per guided request, advances and rolls matchers back, and fills bitmask rows. The server reads
refusals through ``interface.py`` to answer them as 400s. Backends are imported lazily and
created once per engine; a request may pick the other one.
"""

from __future__ import annotations

from typing import Any, Iterable

from guidespec.grammar_backends.interface import GrammarBackend, GrammarError, GrammarMatcher

from guidespec.protocol import GRAMMAR_BACKENDS as BACKENDS

__all__ = [
    "BACKENDS",
    "GrammarBackend",
    "GrammarError",
    "GrammarMatcher",
    "create_backend",
    "import_backends",
    "prepare_tables",
]


def _backend_class(name: str) -> Any:
    if name == "xgrammar":
        from guidespec.grammar_backends.xgrammar_backend import XGrammarBackend

        return XGrammarBackend
    if name == "llguidance":
        from guidespec.grammar_backends.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend
    raise ValueError(f"unknown grammar backend {name!r}; choose one of {', '.join(BACKENDS)}")


def create_backend(
    name: str, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], num_threads: int = 2
) -> GrammarBackend:
    return _backend_class(name)(tokenizer, vocab_size, stop_token_ids, num_threads)  # type: ignore[no-any-return]


def prepare_tables(names: Iterable[str], tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
    """Make the named backends' tables now and keep them (``tables.tokenizer_tables``); a backend
    that fails to import or to make them reports it when it is created."""
    for name in names:
        try:
            _backend_class(name).tables(tokenizer, vocab_size, stop_token_ids, keep=True)
        except Exception:
            pass


def import_backends(names: Iterable[str]) -> None:
    """Import the named backends and their libraries now (xgrammar brings torch and transformers:
    ~3 s of CPU), so that a process forked afterwards has them; one that fails to import reports
    it when it is created."""
    for name in names:
        try:
            if name == "xgrammar":
                import guidespec.grammar_backends.xgrammar_backend  # noqa: F401
            elif name == "llguidance":
                import guidespec.grammar_backends.llguidance_backend  # noqa: F401
        except ImportError:
            pass
