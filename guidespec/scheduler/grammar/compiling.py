"""The compile queue and the cache: each guided request's grammar compiled away from the
scheduler's loop. Makes no matchers and fills no masks (``manager.py`` does, handed each ready
grammar through ``create_matcher``).

- Compiles run in a separate process (``compile_worker.py``, driven through
  ``compile_process.py``), one at a time: a compile cannot be stopped inside the process that
  runs it. A compile that overruns its deadline is stopped for real: the process is killed and
  restarted, the request fails with a clear message, the other queued compiles are sent again.
  What it compiled is loaded here on a load thread (the text read back, or a fast grammar
  compiled again: xgrammar lets go of the GIL meanwhile).
- Results are cached by the canonical grammar (bounded LRU), failures too (a bad schema fails
  fast the second time); requests for the same grammar share one compile.
- With backend "auto", a backend that refuses a grammar (it cannot enforce it exactly) hands it
  to the next one.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from guidespec import envs
from guidespec.grammar_backends import GrammarBackend, GrammarError
from guidespec.grammar_backends.interface import is_refusal
from guidespec.process_utils import lower_thread_priority
from guidespec.protocol import GuidedDecoding, backend_order
from guidespec.scheduler.grammar.compile_process import CompileClient, CompileProcess
from guidespec.scheduler.grammar.settings import GrammarSettings

logger = logging.getLogger(__name__)

# a request's grammar, ready: (its guided, the backends "auto" has left after the one that
# compiled it, why the ones before it refused); (None, [], []) where it has no such choice
Fallback = tuple[GuidedDecoding | None, list[str], list[str]]


@dataclass
class _Job:
    key: str
    backend: str
    guided: GuidedDecoding
    request_ids: list[str] = field(default_factory=list)
    deadline: float | None = None  # set when the compile process starts it
    loading: Future[Any] | None = None  # compiled: its grammar loading on the load thread


class GrammarCompiler:
    """``backend``: the backend of a name (made at first use); ``create_matcher``: called with
    (request, backend, compiled grammar, ``Fallback``) for each request whose grammar is ready;
    ``compile_process``: one made by ``fork_compile_process`` (or ``start_compile_process``) with
    these settings; None starts one here."""

    def __init__(
        self,
        settings: GrammarSettings,
        backend: Callable[[str], GrammarBackend],
        create_matcher: Callable[[str, str, Any, Fallback], None],
        compile_process: CompileProcess | None = None,
    ) -> None:
        self.settings = settings
        self._backend = backend
        self._create_matcher = create_matcher
        self.process = CompileClient(settings, compile_process)
        # a compiled grammar is loaded (its text read back, or a fast one compiled again) on a
        # thread of its own: xgrammar (0.2.8) lets go of the GIL while it compiles, so the loop
        # keeps stepping the other requests meanwhile, at a lower priority than the loop's
        # (``envs.compile_nice``: a compile must not take the cores from the running batch)
        self._loader = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="guidespec-grammar-load",
            initializer=lower_thread_priority,
            initargs=(envs.compile_nice(),),
        )
        self.compiled: OrderedDict[str, Any] = OrderedDict()
        self.recompiled = 0  # grammars compiled again here rather than read back as text
        self.num_compiled = 0  # grammars the compile process compiled
        self.num_shared = 0  # grammars it found compiled by another engine (the shared store)
        self.failed: OrderedDict[str, str] = OrderedDict()
        self.jobs: OrderedDict[int, _Job] = OrderedDict()
        self.job_of_key: dict[str, int] = {}
        self.pending: dict[str, int] = {}  # request id -> job id
        self.fallbacks: dict[
            str, tuple[GuidedDecoding, list[str], list[str]]
        ] = {}  # request -> (guided, backends left, refusals)
        self._job_ids = itertools.count()

    def submit(
        self,
        request_id: str,
        guided: GuidedDecoding,
        backends: list[str] | None = None,
        refusals: list[str] | None = None,
    ) -> bool:
        """Start (or join) the compile; True if the grammar is ready now (its matcher made).
        Raises GrammarError. ``backends``: the ones to try, in order (the guided's order by
        default), and ``refusals``: why others refused or failed."""
        order = list(self._order(guided.backend)) if backends is None else list(backends)
        return self._try(request_id, guided, order, list(refusals or []))

    def _order(self, backend: str | None) -> tuple[str, ...]:
        return backend_order(backend or self.settings.default_backend)

    def _try(self, request_id: str, guided: GuidedDecoding, backends: list[str], refusals: list[str]) -> bool:
        """Start the first of ``backends`` whose compile has not failed (True: ready now)."""
        while backends:
            backend = backends.pop(0)
            key = guided.cache_key(backend)
            error = self.failed.get(key)
            if error is None:
                self.fallbacks[request_id] = (guided, backends, refusals)
                return self._start(request_id, guided, backend, key)
            if not (backends and is_refusal(error)):
                raise GrammarError(_refused(refusals + [error]))
            refusals.append(error)
        raise GrammarError(_refused(refusals))

    def _start(self, request_id: str, guided: GuidedDecoding, backend: str, key: str) -> bool:
        if key in self.compiled:
            self.compiled.move_to_end(key)
            self._ready(request_id, backend, self.compiled[key])
            return True
        job_id = self.job_of_key.get(key)
        if job_id is None:
            job_id = next(self._job_ids)
            self.jobs[job_id] = _Job(key, backend, guided)
            self.job_of_key[key] = job_id
            self.process.send(job_id, backend, guided)
        self.jobs[job_id].request_ids.append(request_id)
        self.pending[request_id] = job_id
        return False

    def poll(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Requests whose grammar became ready, and (request, error) for those that failed."""
        ready: list[str] = []
        failed: list[tuple[str, str]] = []
        for message in self.process.drain():
            self._handle(message, ready, failed)
        for job_id, job in list(self.jobs.items()):
            if job.loading is not None and job.loading.done():
                self._finish_job(job_id)
                self._loaded(job, ready, failed)
        self._enforce_deadline(failed)
        return ready, failed

    @property
    def has_pending(self) -> bool:
        return bool(self.pending)

    def release(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.fallbacks.pop(request_id, None)

    def wait_started(self, timeout_s: float) -> bool:
        """Wait until the compile process has its backend ready; False on timeout."""
        return self.process.started.wait(timeout_s)

    def shutdown(self) -> None:
        self.process.close()
        self._loader.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ helpers

    def _ready(self, request_id: str, backend: str, compiled: Any) -> None:
        """The request's grammar is ready: its matcher made, with what "auto" has left for it."""
        self._create_matcher(request_id, backend, compiled, self.fallbacks.pop(request_id, (None, [], [])))

    def _handle(self, message: dict[str, Any], ready: list[str], failed: list[tuple[str, str]]) -> None:
        if message.get("exited"):
            self._restart("the grammar compile process exited unexpectedly", failed)
            return
        job = self.jobs.get(message.get("job", -1))
        if job is None:
            return
        if message.get("started"):
            job.deadline = time.monotonic() + self.settings.compile_timeout_s
            return
        if message["ok"]:  # loaded on the load thread; ``poll`` makes its matchers once it is done
            job.deadline = None
            if message.get("shared"):
                self.num_shared += 1
            else:
                self.num_compiled += 1
            job.loading = self._loader.submit(self._compiled, job.backend, message)
            return
        self._finish_job(message["job"])
        self._failed_job(job, message["error"], ready, failed)

    def _loaded(self, job: _Job, ready: list[str], failed: list[tuple[str, str]]) -> None:
        assert job.loading is not None
        try:
            compiled = job.loading.result()
        except Exception as e:  # a compiled grammar that cannot be rebuilt here: the job fails
            logger.exception("grammar %s: its compiled grammar could not be loaded", job.key[:200])
            self._failed_job(job, f"internal error loading a compiled grammar: {type(e).__name__}: {e}", ready, failed)
            return
        self._remember(self.compiled, job.key, compiled)
        for request_id in self._waiting(job):
            self._ready(request_id, job.backend, compiled)
            ready.append(request_id)

    def _failed_job(self, job: _Job, error: str, ready: list[str], failed: list[tuple[str, str]]) -> None:
        self._remember(self.failed, job.key, error)
        for request_id in self._waiting(job):
            self._fall_back(request_id, error, ready, failed)

    def _compiled(self, backend: str, message: dict[str, Any]) -> Any:
        """The compile process's grammar: its text read back, or compiled again here from the guided
        it returned (where that is cheaper than its text: ``GrammarSettings.recompile``)."""
        if message["compiled"] is None:
            self.recompiled += 1
            return self._backend(backend).compile(GuidedDecoding(**message["guided"]))
        return self._backend(backend).deserialize(message["compiled"])

    def _fall_back(self, request_id: str, error: str, ready: list[str], failed: list[tuple[str, str]]) -> None:
        """A compile failed: the next backend of an "auto" request where this one refused, else fail."""
        guided, backends, refusals = self.fallbacks.get(request_id, (None, [], []))
        if guided is None or not backends or not is_refusal(error):
            failed.append((request_id, _refused(refusals + [error]) if refusals else error))
            return
        try:
            if self._try(request_id, guided, backends, refusals + [error]):
                ready.append(request_id)
        except GrammarError as e:
            failed.append((request_id, str(e)))

    def _enforce_deadline(self, failed: list[tuple[str, str]]) -> None:
        running = next((j for j in self.jobs.values() if j.deadline is not None), None)
        if running is not None and time.monotonic() > running.deadline:  # type: ignore[operator]
            self._restart(f"grammar compilation took longer than {self.settings.compile_timeout_s:g} s", failed)

    def _restart(self, reason: str, failed: list[tuple[str, str]]) -> None:
        """Kill the compile process, fail the job it was running, send the others again."""
        running_id = next((i for i, j in self.jobs.items() if j.deadline is not None), None)
        if running_id is not None:
            job = self.jobs[running_id]
            self._finish_job(running_id)
            self._remember(self.failed, job.key, reason)
            failed.extend((request_id, reason) for request_id in self._waiting(job))
        self.process.restart()
        for job_id, job in self.jobs.items():
            if job.loading is None:  # (compiled ones load on)
                self.process.send(job_id, job.backend, job.guided)

    def _finish_job(self, job_id: int) -> None:
        job = self.jobs.pop(job_id)
        self.job_of_key.pop(job.key, None)

    def _waiting(self, job: _Job) -> list[str]:
        """The job's requests that are still waiting for it (not aborted meanwhile)."""
        waiting = [r for r in job.request_ids if r in self.pending]
        for request_id in waiting:
            del self.pending[request_id]
        return waiting

    def _remember(self, cache: OrderedDict[str, Any], key: str, value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self.settings.cache_size:
            cache.popitem(last=False)


def _refused(errors: list[str]) -> str:
    if len(errors) == 1:
        return errors[0]
    return "no grammar backend can enforce this exactly: " + "; ".join(errors)
