"""The grammar compile process: compiles grammars away from the scheduler's loop.

A compile cannot be interrupted inside the process that runs it, and a hostile schema can
compile for minutes or take the memory with it. Compiles therefore run here, one at a time, in
a process the scheduler can kill when a compile overruns its deadline (the hard timeout), and
restart. The protocol is JSON lines (never pickle): the scheduler writes a settings line, then
``{"job", "backend", "guided"}`` lines; this process answers ``{"job", "started": true}`` when it
begins a job and ``{"job", "ok", "compiled" | "error"}`` when it ends, where ``compiled`` is the
backend's serialized grammar, or null with ``guided`` (the guided as rewritten) for a grammar the
scheduler should compile again itself (``GrammarSettings.recompile``).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from guidespec.protocol import GuidedDecoding, backend_order


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from guidespec.grammar_backends import GrammarError, create_backend
    from guidespec.grammar_backends.rewrites import rewrite_schema
    from guidespec.model_files import load_tokenizer

    from guidespec import envs

    rewrites = envs.schema_rewrites_enabled()
    settings = json.loads(sys.stdin.readline())
    recompile = settings.get("recompile", "auto")
    tokenizer = load_tokenizer(Path(settings["model_dir"]))
    backends: dict[str, Any] = {}

    def backend(name: str) -> Any:
        if name not in backends:
            backends[name] = create_backend(
                name, tokenizer, settings["vocab_size"], tuple(settings["stop_token_ids"]), settings["num_threads"]
            )
        return backends[name]

    # a backend's setup (xgrammar's tokenizer info: a second or more; llguidance's: half a second)
    # is not part of any request's compile time: the default one, and with "auto" each one it may
    # fall back to, is made before "ready"; any other one before its job "started"
    for name in backend_order(settings["default_backend"]):
        try:
            backend(name)
        except Exception:
            pass  # each job then reports the backend's error itself
    _reply({"ready": True})
    for line in sys.stdin:
        job = json.loads(line)
        try:
            chosen = backend(job["backend"])
            _reply({"job": job["job"], "started": True})
            guided = GuidedDecoding(**job["guided"])
            if guided.kind == "json_schema" and rewrites:  # exact rewrites first (grammar_backends/rewrites/)
                schema, applied = rewrite_schema(json.loads(guided.json_schema))  # type: ignore[arg-type]
                if applied:
                    guided = dataclasses.replace(guided, json_schema=json.dumps(schema))
            start = time.perf_counter()
            compiled = chosen.compile(guided)
            text_cost_s = chosen.text_cost_s(compiled)
            if text_cost_s is not None and (
                recompile == "always" or (recompile == "auto" and time.perf_counter() - start < text_cost_s)
            ):
                # the scheduler compiles it again, for less than the text would cost (the guided as
                # rewritten: the scheduler does not rewrite)
                _reply({"job": job["job"], "ok": True, "compiled": None, "guided": dataclasses.asdict(guided)})
            else:
                _reply({"job": job["job"], "ok": True, "compiled": chosen.serialize(compiled)})
        except GrammarError as e:
            _reply({"job": job["job"], "ok": False, "error": str(e)})
        except Exception as e:
            _reply({"job": job["job"], "ok": False, "error": f"{type(e).__name__}: {e}"})


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
