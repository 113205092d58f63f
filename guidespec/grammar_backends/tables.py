"""Each backend's tables of the vocabulary, made once per tokenizer in a process (see
:func:`tokenizer_tables`)."""

from __future__ import annotations

from typing import Any, Callable

# (backend, tokenizer's id, vocabulary size, stop tokens) -> (the tokenizer, the backend's tables)
_TABLES: dict[tuple[str, int, int, tuple[int, ...]], tuple[Any, Any]] = {}


def tokenizer_tables(
    name: str,
    tokenizer: Any,
    vocab_size: int,
    stop_token_ids: tuple[int, ...],
    make: Callable[[], Any],
    keep: bool = False,
) -> Any:
    """A backend's tables of the vocabulary (xgrammar's ``TokenizerInfo``: 0.3 s for SmolLM2's;
    llguidance's tokenizer: 0.4-0.7 s): the ones kept for this tokenizer, else made by ``make``
    (and kept with ``keep``). They start no thread, so a process forked after they are made has
    them: the scheduler keeps them before it forks its compile process (``prepare_tables``), and
    the two stop making them twice on the same cores at each engine's start. Only what is kept
    stays: a process that makes many backends (tests) holds no tokenizer for them."""
    key = (name, id(tokenizer), vocab_size, tuple(stop_token_ids))
    found = _TABLES.get(key)
    if found is not None and found[0] is tokenizer:
        return found[1]
    tables = make()
    if keep:
        _TABLES[key] = (tokenizer, tables)  # (the tokenizer kept: its id is not reused)
    return tables
