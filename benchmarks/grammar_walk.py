"""What llguidance's compile-time walk costs, and what it refuses: every workload schema through
``rewrite_schema`` and ``LLGuidanceBackend.compile``, the walk (``_walk_first_lexemes``) timed
apart. ``GUIDESPEC_LLGUIDANCE_LEXER_FUEL`` sets the lexer's fuel (issue 45).

    .venv/bin/python benchmarks/grammar_walk.py
    GUIDESPEC_LLGUIDANCE_LEXER_FUEL=200000 .venv/bin/python benchmarks/grammar_walk.py
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from guidespec.grammar_backends import GrammarError, create_backend
from guidespec.grammar_backends.rewrites import rewrite_schema
from guidespec.entrypoints.sweep import default_workload, load_workload
from guidespec.model_files import load_tokenizer, resolve_model_dir
from guidespec.protocol import GuidedDecoding


def main() -> None:
    tokenizer = load_tokenizer(resolve_model_dir(None, show_progress=False))
    backend: Any = create_backend("llguidance", tokenizer, 49152, (2,), 1)
    walk = backend._walk_first_lexemes
    walks: list[float] = []

    def timed(matcher: Any) -> str:
        start = time.perf_counter()
        try:
            return str(walk(matcher))
        finally:
            walks.append(time.perf_counter() - start)

    backend._walk_first_lexemes = timed
    compiles: list[float] = []
    refused: list[tuple[str, str]] = []
    for case in load_workload(default_workload()):
        try:
            schema, _ = rewrite_schema(case["schema"])
        except GrammarError as e:
            refused.append((case["id"], str(e)))
            continue
        start = time.perf_counter()
        try:
            backend.compile(GuidedDecoding(json_schema=json.dumps(schema)))
        except GrammarError as e:
            if "gives up" in str(e):
                refused.append((case["id"], str(e)))
        compiles.append(time.perf_counter() - start)
    ms = sorted(1e3 * w for w in walks)
    print(
        f"{len(compiles)} compiles; walk p50 {statistics.median(ms):.2f} ms, p90 {ms[int(0.9 * len(ms))]:.2f} ms, "
        f"max {ms[-1]:.1f} ms; {100 * sum(walks) / sum(compiles):.1f}% of compile time"
    )
    print(f"refused by the walk (or as matching nothing): {len(refused)}")
    for case_id, error in refused:
        print(f"  {case_id}: {error[:160]}")


if __name__ == "__main__":
    main()
