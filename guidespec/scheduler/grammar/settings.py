"""The grammar side's settings (``GrammarSettings``, made from the scheduler's config) and a
step's fill input (``FillRow``). Plain frozen data: no grammar state lives here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

from guidespec.config import SchedulerConfig


@dataclass(frozen=True)
class GrammarSettings:
    model_dir: Path
    default_backend: str
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    compile_timeout_s: float
    max_rows: int
    num_threads: int = 2  # a compile's (the compile process's)
    # a step's fills: one thread (the scheduler's own) by default. A fill takes tens of microseconds
    # per row, while waking a backend's pool took milliseconds per call: on 2 CPU cores beside the
    # workers' forward (batch 1, n-gram drafts: 14 ms of filling per step with 2 threads, 2 ms with
    # 1) and on an H200's 16-core host beside a GPU worker too (batch 16, EAGLE: a step's verify
    # masks in 11.3 ms p50 with 4 threads, 0.8 ms with 1)
    fill_threads: int = 1
    cache_size: int = 256
    # how the compile process hands a grammar over: "auto" has the scheduler compile it again (on
    # its load thread) where that took less than the backend's estimate of writing and reading
    # its text (``text_cost_s``), else sends the text; "always" / "never" compile again / not
    recompile: str = "auto"
    store_dir: str | None = None  # compiled grammars shared with other engines (store.py), or None


def grammar_settings(cfg: SchedulerConfig) -> GrammarSettings:
    return GrammarSettings(
        cfg.model_dir,
        cfg.grammar_backend,
        cfg.vocab_size,
        cfg.eos_token_ids,
        cfg.grammar_compile_timeout_s,
        cfg.max_batch_size,
        fill_threads=cfg.grammar_fill_threads,
        store_dir=cfg.grammar_cache_dir,
    )


class FillRow(NamedTuple):
    """A guided request to fill masks for: its drafts, its output length and output budget
    (max_tokens, or less where the model length ends first), which only early closing reads (a
    request it does not track may leave them out: ``GrammarManager.budget_tracked``). A named
    tuple: a step makes one a guided row (0.3 µs against a frozen dataclass's 0.8)."""

    request_id: str
    drafts: Sequence[int] = ()
    output_len: int = 0
    max_tokens: int = 1 << 30
