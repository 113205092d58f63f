"""The scheduler's grammar ownership: the matchers and mask fills (``manager.py``), the compile
queue and cache (``compiling.py``), the compile process from the scheduler's side
(``compile_process.py``) and the process itself (``compile_worker.py``), early closing of JSON
outputs (``closing.py``, ``closing_step.py``), and the settings (``settings.py``)."""

from __future__ import annotations

from guidespec.scheduler.grammar.compile_process import (
    CompileProcess,
    ForkedCompileProcess,
    fork_compile_process,
    start_compile_process,
)
from guidespec.scheduler.grammar.manager import GrammarManager
from guidespec.scheduler.grammar.settings import FillRow, GrammarSettings, grammar_settings

__all__ = [
    "CompileProcess",
    "FillRow",
    "ForkedCompileProcess",
    "GrammarManager",
    "GrammarSettings",
    "fork_compile_process",
    "grammar_settings",
    "start_compile_process",
]
