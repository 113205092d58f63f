"""Grammar ownership: the scheduler is the only place grammar state lives.

- Compiles run in a separate process (``compile_worker.py``), one at a time: a compile cannot
  be stopped inside the process that runs it. A compile that overruns its deadline is stopped
  for real: the process is killed and restarted, the request fails with a clear message, the
  other queued compiles are sent again. What it compiled is loaded here on a load thread (the
  text read back, or a fast grammar compiled again: xgrammar lets go of the GIL meanwhile).
- Results are cached by the canonical grammar (bounded LRU), failures too (a bad schema fails
  fast the second time); requests for the same grammar share one compile.
- A request waits UNREADY until its grammar is ready; ``poll`` hands back the ready and the
  failed ones.
- One matcher per guided request: filled in batches per backend (the backends' multi-threaded
  fills), advanced by exactly the accepted tokens, asked for forced tokens (jump-forward).
- JSON requests that loop or near ``max_tokens`` are steered to close (``closing.py``).
- A matcher that stops without finishing (a backend's limit met mid-way) is never an end: a
  fill finds it, its rows allow only a stop token that is never used, and ``take_failures``
  hands it to the scheduler, which fails the request or starts it again on another backend
  (``alternatives``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, TypeVar

import numpy as np

from guidespec.config import SchedulerConfig
from guidespec.grammar_backends import GrammarBackend, GrammarError, GrammarMatcher, create_backend, import_backends
from guidespec.bitmask import allowed_ids, bitmask_row, bitmask_width
from guidespec.grammar_backends.interface import is_refusal
from guidespec.model_files import import_tokenizers
from guidespec.protocol import GuidedDecoding, backend_order
from guidespec.scheduler.closing_step import ClosingStep

logger = logging.getLogger(__name__)
_Method = TypeVar("_Method", bound=Callable[..., Any])


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


def grammar_settings(cfg: SchedulerConfig) -> GrammarSettings:
    return GrammarSettings(
        cfg.model_dir,
        cfg.grammar_backend,
        cfg.vocab_size,
        cfg.eos_token_ids,
        cfg.grammar_compile_timeout_s,
        cfg.max_batch_size,
        fill_threads=cfg.grammar_fill_threads,
    )


@dataclass(frozen=True)
class FillRow:
    """A guided request to fill masks for: its drafts, its output length and output budget
    (max_tokens, or less where the model length ends first)."""

    request_id: str
    drafts: list[int] = field(default_factory=list)
    output_len: int = 0
    max_tokens: int = 1 << 30


def _settled(method: _Method) -> _Method:
    """A GrammarManager method that uses grammars: the draft steps' walk ends first."""

    @functools.wraps(method)
    def settled(self: GrammarManager, *args: Any, **kwargs: Any) -> Any:
        if self._walks:
            self.end_draft_walk()
        return method(self, *args, **kwargs)

    return settled  # type: ignore[return-value]


@dataclass
class _Walk:
    """Where a request's grammar is during a step's draft steps: the tokens sent so far, how many
    of them it accepted, and whether it refused one (then it stays before that token)."""

    tokens: list[int] = field(default_factory=list)
    accepted: int = 0
    refused: bool = False


@dataclass
class _Job:
    key: str
    backend: str
    guided: GuidedDecoding
    request_ids: list[str] = field(default_factory=list)
    deadline: float | None = None  # set when the compile process starts it
    loading: Future[Any] | None = None  # compiled: its grammar loading on the load thread


class GrammarManager:
    """``compile_process``: one made by ``fork_compile_process`` (or ``start_compile_process``)
    with these settings; None starts one here."""

    def __init__(
        self, settings: GrammarSettings, tokenizer: Any, compile_process: CompileProcess | None = None
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.backends: dict[str, GrammarBackend] = {}
        self.process = _CompileProcess(settings, compile_process)  # before the backend below: it imports meanwhile
        # deserializing needs a backend: the default one, and with "auto" the ones it falls back
        # to (llguidance's setup takes half a second), are made before the first step
        first, *others = self._order(None)
        self._backend(first)
        for name in others:
            try:
                self._backend(name)
            except Exception as e:  # (not installed): a request that needs it reports why
                logger.warning("grammar backend %s is not available: %s", name, e)
        # a compiled grammar is loaded (its text read back, or a fast one compiled again) on a
        # thread of its own: xgrammar (0.2.8) lets go of the GIL while it compiles, so the loop
        # keeps stepping the other requests meanwhile
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guidespec-grammar-load")
        self.compiled: OrderedDict[str, Any] = OrderedDict()
        self.recompiled = 0  # grammars compiled again here rather than read back as text
        self.failed: OrderedDict[str, str] = OrderedDict()
        self.jobs: OrderedDict[int, _Job] = OrderedDict()
        self.job_of_key: dict[str, int] = {}
        self.pending: dict[str, int] = {}  # request id -> job id
        self.matchers: dict[str, tuple[str, GrammarMatcher]] = {}
        self._walks: dict[str, _Walk] = {}  # a step's draft steps (fill_after): request -> its walk
        self.fallbacks: dict[
            str, tuple[GuidedDecoding, list[str], list[str]]
        ] = {}  # request -> (guided, backends left, refusals)
        self.refusals: dict[str, str] = {}  # request -> why a backend before the one serving it refused
        # request -> (guided, the backends "auto" has left after the one serving it, why the ones
        # before it refused): where it starts again if its grammar fails mid-way
        self.alternatives: dict[str, tuple[GuidedDecoding, list[str], list[str]]] = {}
        self.failures: dict[str, str] = {}  # request -> why its matcher failed (found by a fill)
        self.closing = ClosingStep(tokenizer, settings.vocab_size, settings.stop_token_ids)
        self._job_ids = itertools.count()
        self.bitmask = np.zeros((settings.max_rows, bitmask_width(settings.vocab_size)), dtype=np.int32)
        self._stop_row = bitmask_row(settings.stop_token_ids, settings.vocab_size)

    # ------------------------------------------------------------------ compile

    def submit(
        self,
        request_id: str,
        guided: GuidedDecoding,
        backends: list[str] | None = None,
        refusals: list[str] | None = None,
    ) -> bool:
        """Start (or join) the compile; True if the matcher is ready now. Raises GrammarError.
        With backend "auto", a backend that refuses the grammar (it cannot enforce it exactly)
        hands it to the next one; GrammarError says why each refused. ``backends`` (and why
        others refused or failed) where a request starts again on the ones left to it."""
        self.closing.track(request_id, guided)
        try:
            order = list(self._order(guided.backend)) if backends is None else list(backends)
            return self._try(request_id, guided, order, list(refusals or []))
        except GrammarError:
            self.closing.forget(request_id)
            raise

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

    def served(self, request_id: str) -> tuple[str, str]:
        """(the backend enforcing the request's grammar, why one before it refused or "")."""
        backend = self.matchers[request_id][0] if request_id in self.matchers else ""
        return backend, self.refusals.get(request_id, "")

    def _start(self, request_id: str, guided: GuidedDecoding, backend: str, key: str) -> bool:
        if key in self.compiled:
            self.compiled.move_to_end(key)
            self._create_matcher(request_id, backend, self.compiled[key])
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

    @_settled
    def release(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.fallbacks.pop(request_id, None)
        self.refusals.pop(request_id, None)
        self.alternatives.pop(request_id, None)
        self.failures.pop(request_id, None)
        self.matchers.pop(request_id, None)
        self.closing.forget(request_id)

    # ------------------------------------------------------------------ per step

    @_settled
    def fill(self, rows: list[FillRow], out: np.ndarray | None = None) -> np.ndarray:
        """One bitmask row per position to verify, request by request: a request with drafts
        ``d_1..d_k`` gets rows for its current state and after each ``d_j`` (its grammar is
        advanced through the drafts, filled at each depth, and rolled back). Fills are batched
        per backend and depth. Returns [sum(1 + len(drafts)), ceil(vocab / 32)]: the first rows
        of ``out`` where it has room (the mask arena's buffer: the rows are then written once),
        else of this manager's own buffer."""
        needed = sum(1 + len(r.drafts) for r in rows)
        if out is None or out.shape[0] < needed or out.shape[1] != self.bitmask.shape[1]:
            return self._fill_rows_of(rows)
        own, self.bitmask = self.bitmask, out
        try:
            return self._fill_rows_of(rows)
        finally:
            self.bitmask = own

    def _fill_rows_of(self, rows: list[FillRow]) -> np.ndarray:
        firsts = np.cumsum([0] + [1 + len(r.drafts) for r in rows]).tolist()
        if firsts[-1] > self.bitmask.shape[0]:
            self.bitmask = np.zeros((firsts[-1], self.bitmask.shape[1]), dtype=np.int32)
        for r in rows:
            self.closing.check_budget(r.request_id, r.output_len, r.max_tokens, *self._grammar(r.request_id))
        saved = self.closing.snapshot([r.request_id for r in rows if r.drafts])
        depths = [len(r.drafts) for r in rows]  # how deep each request's grammar can follow its drafts
        drafting = [i for i in range(len(rows)) if depths[i]]
        accepted = [0] * len(rows)
        try:
            for depth in range(max(depths, default=0) + 1):
                active = [i for i in range(len(rows)) if depths[i] >= depth]
                # a drafting request's own row comes last, once its drafts are rolled back: the
                # last fill of its grammar is then where it stands (llguidance_backend.py: a
                # mask kept from a rolled-back state costs a fill to refresh otherwise)
                filled = [i for i in active if depth or not rows[i].drafts]
                self._fill_depth(rows, firsts, depth, filled)
                for i in active:
                    if depth == depths[i] or self.matchers[rows[i].request_id][1].is_terminated():
                        continue  # (a draft that ended the grammar: its rows after allow only a stop token)
                    if self._accept_draft(rows[i].request_id, rows[i].drafts[depth]):
                        accepted[i] += 1
                    else:  # an unchecked draft the grammar rejects: verification refuses it at this
                        depths[i] = depth  # row; the rows after it allow nothing (masks fail closed)
                        self.bitmask[firsts[i] + depth + 1 : firsts[i + 1]] = 0
        finally:
            for i, r in enumerate(rows):
                if accepted[i]:
                    self.matchers[r.request_id][1].rollback(accepted[i])
            self.closing.restore(saved)
        self._fill_depth(rows, firsts, 0, drafting)
        for i, r in enumerate(rows):  # a matcher that failed (at any depth: it stays failed) ends nothing
            reason = self._error(r.request_id)
            if reason:
                self.failures[r.request_id] = reason
                self.bitmask[firsts[i] : firsts[i + 1]] = self._stop_row  # (its token is never used)
        return self.bitmask[: firsts[-1]]

    def _fill_depth(self, rows: list[FillRow], firsts: list[int], depth: int, which: list[int]) -> None:
        """The rows at ``depth`` of requests ``which`` (their grammars there): filled by their
        backends, a stop token where a draft ended the grammar, then narrowed by early closing."""
        ended = [i for i in which if self.matchers[rows[i].request_id][1].is_terminated()]
        live = [i for i in which if i not in ended]
        self._fill_rows([rows[i].request_id for i in live], [firsts[i] + depth for i in live])
        for i in ended:  # a draft ended the grammar: only a stop token may follow
            self.bitmask[firsts[i] + depth] = self._stop_row
        for i in live:  # early closing, as its own step after the backend's fill
            r = rows[i]
            out_row = self.bitmask[firsts[i] + depth]
            self.closing.restrict(
                r.request_id, r.output_len + depth, r.max_tokens, out_row, *self._grammar(r.request_id)
            )

    def take_failures(self) -> list[tuple[str, str]]:
        """(request, why) for each request whose matcher a fill found failed since the last call."""
        failures = list(self.failures.items())
        self.failures.clear()
        return failures

    @_settled
    def prepare(self, request_id: str, max_tokens: int) -> None:
        """Work for the request's first mask that needs only its grammar (the first budget check's
        dry run of closing: ``ClosingStep.check_budget``), done ahead of the step that needs it."""
        if request_id in self.matchers:
            self.closing.check_budget(request_id, 0, max_tokens, *self._grammar(request_id))

    def stop_rows(self, count: int) -> np.ndarray:
        """``count`` mask rows that allow only a stop token (a failed request's rows of a step)."""
        return np.repeat(self._stop_row[None], count, axis=0)

    def fill_after(self, request_ids: list[str], sequences: list[list[int]]) -> np.ndarray:
        """One mask row per request, for its state after ``sequences[i]`` (tokens past its final
        ones: a draft step's mask). A sequence the grammar refuses gets a row that allows nothing;
        one that ends the grammar allows only a stop token.

        A step's draft steps send each request its sequence so far, one token longer each time:
        the grammar stays where the last call left it and walks only the new tokens (a sequence
        that does not extend the last one starts again). ``end_draft_walk`` puts every grammar
        back as it was; every other method that uses a grammar does that first (``_settled``)."""
        if len(request_ids) > self.bitmask.shape[0]:
            self.bitmask = np.zeros((len(request_ids), self.bitmask.shape[1]), dtype=np.int32)
        live: list[int] = []
        for row, (request_id, sequence) in enumerate(zip(request_ids, sequences)):
            matcher = self.matchers[request_id][1]
            walked = self._walks.get(request_id)
            if walked is None or sequence[: len(walked.tokens)] != walked.tokens:
                if walked is not None:
                    matcher.rollback(walked.accepted)
                walked = self._walks[request_id] = _Walk()
            new = sequence[len(walked.tokens) :]
            if not walked.refused:  # (past a refused token every sequence is refused)
                count = matcher.advance(new)
                walked.accepted += count
                walked.refused = count < len(new)
            walked.tokens = list(sequence)
            if walked.refused:
                self.bitmask[row] = 0
            elif matcher.is_terminated():
                self.bitmask[row] = self._stop_row
            else:
                live.append(row)
        self._fill_rows([request_ids[row] for row in live], live)
        return self.bitmask[: len(request_ids)]

    def end_draft_walk(self) -> None:
        """Every grammar back where the step's draft steps found it (``fill_after``)."""
        if not self._walks:
            return
        for request_id, walked in self._walks.items():
            entry = self.matchers.get(request_id)
            if entry is not None and walked.accepted:
                entry[1].rollback(walked.accepted)
        self._walks.clear()

    @_settled
    def forced_tokens(self, request_id: str, limit: int) -> list[int]:
        """The tokens the grammar forces next (the matcher is left as it was)."""
        return self.matchers[request_id][1].forced_tokens(limit)

    @_settled
    def valid_prefix(self, request_id: str, prefix: list[int], tokens: Any) -> int:
        """How many of ``tokens`` the grammar accepts after ``prefix`` (the matcher is left as it was)."""
        matcher = self.matchers[request_id][1]
        accepted = 0
        for token in prefix:
            if not matcher.accept_token(token):
                matcher.rollback(accepted)
                return 0
            accepted += 1
        count = 0
        for token in tokens:
            if matcher.is_terminated() or not matcher.accept_token(int(token)):
                break
            count += 1
        matcher.rollback(accepted + count)
        return count

    @_settled
    def accept(self, request_id: str, token: int) -> bool:
        self.closing.add(request_id, token)
        return self.matchers[request_id][1].accept_token(token)

    def near_budget(self, request_id: str, budget: int, produced: int) -> None:
        self.closing.near_budget(request_id, budget, produced)

    def closing_reason(self, request_id: str) -> str:
        return self.closing.reason(request_id)

    @_settled
    def accept_forced(self, request_id: str, limit: int) -> list[int]:
        """Accept and return the tokens the grammar forces next (jump-forward)."""
        matcher = self.matchers[request_id][1]
        forced = matcher.forced_tokens(limit)
        for i, token in enumerate(forced):
            if not matcher.accept_token(token):
                return forced[:i]
            self.closing.add(request_id, token)
        return forced

    @_settled
    def end_token(self, request_id: str) -> int | None:
        """The stop token, where the grammar allows it and nothing else now (the output is
        complete: the request can end without a step); None otherwise. Checked with a trial
        accept first, so a grammar that cannot end here costs no fill."""
        matcher = self.matchers[request_id][1]
        stops = self.settings.stop_token_ids
        if not stops or matcher.is_terminated() or not matcher.accept_token(stops[0]):
            return None
        matcher.rollback(1)
        row = np.zeros((1, self.bitmask.shape[1]), dtype=np.int32)
        self.backends[self.matchers[request_id][0]].fill_bitmasks([matcher], row, [0])
        return stops[0] if allowed_ids(row[0], limit=2).tolist() == [stops[0]] else None

    @_settled
    def is_terminated(self, request_id: str) -> bool:
        return self.matchers[request_id][1].is_terminated()

    @_settled
    def error(self, request_id: str) -> str:
        """The backend's reason if the request's matcher failed (empty otherwise)."""
        return self._error(request_id)

    def _error(self, request_id: str) -> str:
        backend, matcher = self.matchers[request_id]
        reason = matcher.error()
        return f"{backend} gave up: {reason}" if reason else ""

    def wait_started(self, timeout_s: float) -> bool:
        """Wait until the compile process has its backend ready (at the engine's start: its imports
        would otherwise share the cores with the first requests' forwards); False on timeout."""
        return self.process.started.wait(timeout_s)

    def shutdown(self) -> None:
        self.process.close()
        self._loader.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ helpers

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
            self._create_matcher(request_id, job.backend, compiled)
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

    def _fill_rows(self, request_ids: list[str], out_rows: list[int]) -> None:
        """Fill ``self.bitmask[out_rows[i]]`` from each request's matcher, batched per backend."""
        by_backend: dict[str, tuple[list[GrammarMatcher], list[int]]] = {}
        for request_id, out_row in zip(request_ids, out_rows):
            backend, matcher = self.matchers[request_id]
            matchers, rows = by_backend.setdefault(backend, ([], []))
            matchers.append(matcher)
            rows.append(out_row)
        for backend, (matchers, rows) in by_backend.items():
            self.backends[backend].fill_bitmasks(matchers, self.bitmask, rows)

    @_settled
    def closing_length(self, request_id: str, limit: int) -> int | None:
        """How many tokens closing would take from here to the end of the document (with the stop
        token); None if more than ``limit``."""
        run, ended = self.closing_run(request_id, limit)
        return len(run) if ended or len(run) <= limit else None

    @_settled
    def closing_run(self, request_id: str, limit: int) -> tuple[list[int], bool]:
        """A dry run of closing from the grammar's state (``ClosingStep.dry_run``)."""
        return self.closing.dry_run(request_id, *self._grammar(request_id), limit)

    def _grammar(self, request_id: str) -> tuple[GrammarBackend, GrammarMatcher]:
        backend, matcher = self.matchers[request_id]
        return self.backends[backend], matcher

    def _accept_draft(self, request_id: str, token: int) -> bool:
        if not self.matchers[request_id][1].accept_token(token):
            return False
        self.closing.add(request_id, token)
        return True

    def _backend(self, name: str) -> GrammarBackend:
        if name not in self.backends:
            s = self.settings
            self.backends[name] = create_backend(name, self.tokenizer, s.vocab_size, s.stop_token_ids, s.fill_threads)
        return self.backends[name]

    def _create_matcher(self, request_id: str, backend: str, compiled: Any) -> None:
        self.matchers[request_id] = (backend, self._backend(backend).create_matcher(compiled))
        guided, backends, refusals = self.fallbacks.pop(request_id, (None, [], []))
        if refusals:
            self.refusals[request_id] = "; ".join(refusals)
        if guided is not None and backends:
            self.alternatives[request_id] = (guided, list(backends), list(refusals))

    def _remember(self, cache: OrderedDict[str, Any], key: str, value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self.settings.cache_size:
            cache.popitem(last=False)


class _CompileProcess:
    """The compile subprocess and a thread reading its JSON-line answers into a queue."""

    def __init__(self, settings: GrammarSettings, proc: CompileProcess | None = None) -> None:
        self.settings = settings
        self.answers: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.generation = 0
        self.started = threading.Event()  # the first process said "ready" (or exited)
        self._start(proc)

    def send(self, job_id: int, backend: str, guided: GuidedDecoding) -> None:
        line = json.dumps({"job": job_id, "backend": backend, "guided": dataclasses.asdict(guided)})
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the reader thread reports the exit; the job is sent again after the restart

    def drain(self) -> list[dict[str, Any]]:
        """Answers of the current process so far (answers of a killed one are dropped)."""
        out: list[dict[str, Any]] = []
        while True:
            try:
                generation, message = self.answers.get_nowait()
            except queue.Empty:
                return out
            if generation == self.generation:
                out.append(message)

    def restart(self) -> None:
        self.close()
        self.generation += 1
        self._start()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=5)

    def _start(self, proc: CompileProcess | None = None) -> None:
        self.proc = proc or start_compile_process(self.settings)  # a restart: its own imports (threads run here)
        threading.Thread(
            target=self._read, args=(self.proc, self.generation), daemon=True, name="guidespec-compile-reader"
        ).start()

    def _read(self, proc: CompileProcess, generation: int) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            message = json.loads(line)
            if message.get("ready"):
                self.started.set()
            else:
                self.answers.put((generation, message))
        self.started.set()
        self.answers.put((generation, {"exited": True}))


class ForkedCompileProcess:
    """The compile process forked from the scheduler's, as much of a ``Popen`` as
    ``_CompileProcess`` uses: its JSON lines through two pipes."""

    def __init__(self, pid: int, stdin: IO[str], stdout: IO[str]) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"compile process {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]


CompileProcess = subprocess.Popen[str] | ForkedCompileProcess


def fork_compile_process(settings: GrammarSettings) -> ForkedCompileProcess:
    """The compile process, forked from this one: the scheduler's process calls it once its
    imports (torch, xgrammar, transformers: ~3 s of CPU) are done and before it starts a thread,
    so the compile process has them for nothing (spawned, it ran them again beside the
    scheduler's and the worker's on the same cores: ~1.5 s of each engine start on 2 cores)."""
    import_backends(backend_order(settings.default_backend))
    import_tokenizers()
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()  # (read end, write end) pairs: child reads to_child's read end
    pid = os.fork()
    if pid == 0:  # the compile process: its ends on stdin and stdout, never back into the caller
        code = 1
        try:
            os.dup2(to_child, 0)
            os.dup2(from_child, 1)
            for fd in (to_child, from_parent, to_parent, from_child):
                os.close(fd)
            sys.stdin = open(0, encoding="utf-8", closefd=False)
            sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)
            from guidespec.process_utils import setup_child_process
            from guidespec.scheduler import compile_worker

            setup_child_process("compile")
            compile_worker.main()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            os._exit(code)
    os.close(to_child)
    os.close(from_child)
    proc = ForkedCompileProcess(
        pid, open(from_parent, "w", encoding="utf-8", buffering=1), open(to_parent, encoding="utf-8")
    )
    _write_settings(proc.stdin, settings)
    return proc


def start_compile_process(settings: GrammarSettings) -> subprocess.Popen[str]:
    """The compile process (``compile_worker.py``) as a new interpreter, its settings line written."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "guidespec.scheduler.compile_worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    assert proc.stdin is not None
    _write_settings(proc.stdin, settings)
    return proc


def _write_settings(stdin: IO[str], settings: GrammarSettings) -> None:
    fields = {
        "model_dir": str(settings.model_dir),
        "default_backend": settings.default_backend,
        "vocab_size": settings.vocab_size,
        "stop_token_ids": list(settings.stop_token_ids),
        "num_threads": settings.num_threads,
        "recompile": settings.recompile,
    }
    stdin.write(json.dumps(fields) + "\n")
    stdin.flush()


def _refused(errors: list[str]) -> str:
    if len(errors) == 1:
        return errors[0]
    return "no grammar backend can enforce this exactly: " + "; ".join(errors)
