"""The grammar compile process: compiles grammars away from the scheduler's loop.

A compile cannot be interrupted inside the process that runs it, and a hostile schema can
compile for minutes or take the memory with it. Compiles therefore run here, one at a time, in
a process the scheduler can kill when a compile overruns its deadline (the hard timeout), and
restart. The protocol is JSON lines (never pickle): the scheduler writes a settings line, then
``{"job", "backend", "guided"}`` lines; this process answers ``{"job", "started": true}`` when it
begins a job and ``{"job", "ok", "compiled" | "error"}`` when it ends, where ``compiled`` is the
backend's serialized grammar, or null with ``guided`` (the guided as rewritten) for a grammar the
scheduler should compile again itself (``GrammarSettings.recompile``). With a shared store
(``store.py``: the settings' ``store_dir``) a job is looked up there first (the answer then says
``"shared": true`` and nothing is compiled), and what is compiled is written there for the other
engines.
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
    from guidespec import envs
    from guidespec.process_utils import background_process, die_with_parent

    die_with_parent()  # (also when started as a new interpreter: it leaves the scheduler's group)
    background_process(envs.compile_nice())  # (before any thread starts: they all inherit it)
    from guidespec.grammar_backends import GrammarError, create_backend
    from guidespec.grammar_backends.rewrites import rewrite_schema
    from guidespec.model_files import shared_tokenizer

    rewrites = envs.schema_rewrites_enabled()
    settings = json.loads(sys.stdin.readline())
    recompile = settings.get("recompile", "auto")
    tokenizer = shared_tokenizer(Path(settings["model_dir"]))  # (forked: the scheduler's, its tables made)
    store = None
    if settings.get("store_dir"):
        from guidespec.scheduler.grammar.store import GrammarStore, fingerprint

        store = GrammarStore(
            settings["store_dir"],
            fingerprint(settings["model_dir"], settings["vocab_size"], settings["stop_token_ids"], rewrites),
        )
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
        claimed = ""  # the store's claim on this job's grammar, released once it is done
        try:
            chosen = backend(job["backend"])
            _reply({"job": job["job"], "started": True})
            guided = GuidedDecoding(**job["guided"])
            if store is not None:
                key = guided.cache_key(job["backend"])
                shared = _shared(store, key, settings["compile_timeout_s"])
                if shared is not None:  # another engine compiled it
                    _reply({"job": job["job"], "ok": True, "compiled": shared, "shared": True})
                    continue
                claimed = key
            if guided.kind == "json_schema" and rewrites:  # exact rewrites first (grammar_backends/rewrites/)
                schema, applied = rewrite_schema(json.loads(guided.json_schema))  # type: ignore[arg-type]
                if applied:
                    guided = dataclasses.replace(guided, json_schema=json.dumps(schema))
            start = time.perf_counter()
            compiled = chosen.compile(guided)
            text_cost_s = chosen.text_cost_s(compiled)
            text = chosen.serialize(compiled) if store is not None else None
            if store is not None and text is not None:
                store.put(claimed, text)
            if text_cost_s is not None and (
                recompile == "always" or (recompile == "auto" and time.perf_counter() - start < text_cost_s)
            ):
                # the scheduler compiles it again, for less than the text would cost (the guided as
                # rewritten: the scheduler does not rewrite)
                _reply({"job": job["job"], "ok": True, "compiled": None, "guided": dataclasses.asdict(guided)})
            else:
                _reply({"job": job["job"], "ok": True, "compiled": text or chosen.serialize(compiled)})
        except GrammarError as e:
            _reply({"job": job["job"], "ok": False, "error": str(e)})
        except Exception as e:
            _reply({"job": job["job"], "ok": False, "error": f"{type(e).__name__}: {e}"})
        finally:
            if claimed and store is not None:
                store.release(claimed)  # (after a failed compile, an engine waiting for it compiles it itself)


def _shared(store: Any, key: str, timeout_s: float) -> str | None:
    """The grammar's text if another engine compiled it, or is compiling it now (waited for);
    None: compile it here (claimed: ``store.release`` once done)."""
    text = store.get(key)
    if text is not None:
        return str(text)
    while not store.claim(key):
        text = store.wait(key, timeout_s)
        if text is not None:
            return str(text)
    return None


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
