"""Which schemas each grammar backend compiles (enforces exactly), and backend ``auto``.

    python -m benchmarks.coverage [--schemas ../shared/data/jsonschemabench/schemas] [--timeout 30] [--list]
                                  [--by-rewrite]

Every schema goes through the engine's own grammar manager (the compile process, its deadline,
the fallback of ``auto``), once per backend: xgrammar, llguidance, auto (xgrammar, then
llguidance where xgrammar refuses). Prints a table per JSONSchemaBench category: schemas, and how
many each compiles; then the refusals of ``auto`` by keyword (``--list``: every schema ``auto``
refuses, with the error; ``--by-rewrite``: per exact rewrite, the schemas ``auto`` compiles that
it refuses with that one rewrite off, compiled in this process through both backends). Compiling is not generating:
``guidespec sweep`` checks that the outputs of the compiled ones are valid.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from guidespec.grammar_backends import GrammarError  # noqa: E402
from guidespec.grammar_backends.interface import refusals_in  # noqa: E402
from guidespec.protocol import GuidedDecoding  # noqa: E402
from guidespec.scheduler.grammar import GrammarManager, GrammarSettings  # noqa: E402
from guidespec.model_files import eos_token_ids, load_hf_config, load_tokenizer, resolve_model_dir  # noqa: E402

DEFAULT_SCHEMAS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "jsonschemabench" / "schemas"
BACKENDS = ("xgrammar", "llguidance", "auto")


def category(name: str) -> str:
    return name.split("---")[0] if "---" in name else name.rsplit("_", 1)[0]


def compile_all(schemas: dict[str, str], backend: str, timeout_s: float) -> dict[str, str | None]:
    """Schema name -> None (compiled) or the error."""
    model_dir = resolve_model_dir(None, show_progress=False)
    tokenizer = load_tokenizer(model_dir)
    hf = load_hf_config(model_dir)
    settings = GrammarSettings(
        model_dir, backend, hf.vocab_size, eos_token_ids(model_dir, hf, tokenizer), timeout_s, 16
    )
    manager = GrammarManager(settings, tokenizer)
    manager.wait_started(120)
    results: dict[str, str | None] = {}
    try:
        for name, text in schemas.items():
            try:
                if manager.submit(name, GuidedDecoding(json_schema=text)):
                    results[name] = None
            except GrammarError as e:
                results[name] = str(e)
            except ValueError as e:  # not a schema the request boundary would take
                results[name] = f"invalid: {e}"
            while manager.has_pending:
                ready, failed = manager.poll()
                results.update({r: None for r in ready})
                results.update(dict(failed))
                time.sleep(0.005)
            manager.release(name)
    finally:
        manager.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", default=str(DEFAULT_SCHEMAS))
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--list", action="store_true", help="print every schema auto refuses, with the error")
    parser.add_argument("--by-rewrite", action="store_true", help="the schemas each exact rewrite unlocks")
    args = parser.parse_args()
    schemas = {
        p.stem: json.dumps(json.loads(p.read_text())["schema"]) for p in sorted(Path(args.schemas).glob("*.json"))
    }
    runs = {backend: compile_all(schemas, backend, args.timeout) for backend in BACKENDS}
    by_category: dict[str, list[str]] = collections.defaultdict(list)
    for name in schemas:
        by_category[category(name)].append(name)
    print("| category | schemas | " + " | ".join(BACKENDS) + " |")
    print("|---|---:|" + "---:|" * len(BACKENDS))
    for cat, names in sorted(by_category.items()):
        cells = [sum(runs[b][n] is None for n in names) for b in BACKENDS]
        print(f"| {cat} | {len(names)} | " + " | ".join(map(str, cells)) + " |")
    total = [sum(r is None for r in runs[b].values()) for b in BACKENDS]
    print(f"| **all** | {len(schemas)} | " + " | ".join(f"{t} ({100 * t / len(schemas):.1f}%)" for t in total) + " |")
    keywords = collections.Counter(k for error in runs["auto"].values() if error for _, k in refusals_in(error))
    print("\nauto's refusals by the keyword each backend named:", dict(keywords.most_common()))
    if args.list:
        for name, error in sorted(runs["auto"].items()):
            if error:
                print(f"{name}\t{error}")
    if args.by_rewrite:
        compiled = {name: schemas[name] for name, error in runs["auto"].items() if error is None}
        for rewrite, names in unlocked_by_rewrite(compiled).items():
            print(f"{rewrite}: {len(names)} {' '.join(sorted(names))}")


def unlocked_by_rewrite(schemas: dict[str, str]) -> dict[str, list[str]]:
    """Per rewrite, the schemas (which both backends compile in this process with every rewrite)
    that neither compiles with that rewrite off; "all rewrites" for all of them off."""
    from guidespec.grammar_backends import create_backend
    from guidespec.grammar_backends.rewrites import REWRITES, rewrite_schema

    model_dir = resolve_model_dir(None, show_progress=False)
    tokenizer, hf = load_tokenizer(model_dir), load_hf_config(model_dir)
    stops = eos_token_ids(model_dir, hf, tokenizer)
    backends = [create_backend(name, tokenizer, hf.vocab_size, stops) for name in ("xgrammar", "llguidance")]

    def compiles(schema: object) -> bool:
        for backend in backends:
            try:
                backend.compile(GuidedDecoding(json_schema=json.dumps(schema)))
                return True
            except GrammarError:
                continue
        return False

    out: dict[str, list[str]] = {name: [] for name in ("all rewrites", *REWRITES)}
    for name, text in schemas.items():
        schema = json.loads(text)
        applied = set(rewrite_schema(schema)[1])
        if not applied or not compiles(rewrite_schema(schema)[0]):
            continue
        for rewrite in ("all rewrites", *sorted(applied)):
            off = frozenset(REWRITES) if rewrite == "all rewrites" else frozenset({rewrite})
            if not compiles(rewrite_schema(schema, off)[0]):
                out[rewrite].append(name)
    return out


if __name__ == "__main__":
    main()
