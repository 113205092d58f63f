"""Grammar ownership: the scheduler is the only place grammar state lives.

- Compiles run in a thread pool; results are cached by the canonical grammar (bounded LRU)
  and failures are cached too, so a bad schema fails fast the second time. Requests for the
  same grammar share one compile.
- A request waits UNREADY until its grammar is compiled; ``poll`` hands back the ready and the
  failed ones (a compile past its deadline fails that request alone).
- One matcher per guided request: filled in batches per backend (the backends' multi-threaded
  fills), advanced by exactly the accepted tokens, asked for forced tokens (jump-forward).

Backends are created on first use, in a compile thread, so the scheduler loop never waits
for a tokenizer conversion. Note: a compile that overruns its deadline fails its request at
once, but the compile thread itself runs on to completion (the backends cannot be cancelled).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from guidespec.grammar_backends import GrammarBackend, GrammarError, GrammarMatcher, create_backend
from guidespec.grammar_backends.interface import bitmask_width
from guidespec.protocol import GuidedDecoding


@dataclass(frozen=True)
class GrammarSettings:
    default_backend: str
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    compile_timeout_s: float
    max_rows: int
    num_threads: int = 2
    cache_size: int = 256


@dataclass
class _Pending:
    key: str
    backend: str
    future: Future[Any]
    deadline: float


class GrammarManager:
    def __init__(self, settings: GrammarSettings, tokenizer: Any) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.backends: dict[str, GrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self.pool = ThreadPoolExecutor(settings.num_threads, thread_name_prefix="guidespec-compile")
        self.compiled: OrderedDict[str, Any] = OrderedDict()
        self.failed: OrderedDict[str, str] = OrderedDict()
        self.in_flight: dict[str, Future[Any]] = {}
        self.pending: dict[str, _Pending] = {}
        self.matchers: dict[str, tuple[str, GrammarMatcher]] = {}
        self.bitmask = np.zeros((settings.max_rows, bitmask_width(settings.vocab_size)), dtype=np.int32)

    # ------------------------------------------------------------------ compile

    def submit(self, request_id: str, spec: GuidedDecoding) -> bool:
        """Start (or reuse) the compile; True if the matcher is ready now. Raises GrammarError."""
        backend = spec.backend or self.settings.default_backend
        key = spec.cache_key(backend)
        if key in self.failed:
            raise GrammarError(self.failed[key])
        if key in self.compiled:
            self.compiled.move_to_end(key)
            self._create_matcher(request_id, backend, self.compiled[key])
            return True
        future = self.in_flight.get(key)
        if future is None:
            future = self.pool.submit(self._compile, backend, spec)
            self.in_flight[key] = future
        self.pending[request_id] = _Pending(key, backend, future, time.monotonic() + self.settings.compile_timeout_s)
        return False

    def poll(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Requests whose grammar became ready, and (request, error) for those that failed."""
        ready, failed = [], []
        now = time.monotonic()
        for request_id, pending in list(self.pending.items()):
            if pending.future.done():
                del self.pending[request_id]
                self.in_flight.pop(pending.key, None)
                error = pending.future.exception()
                if error is None:
                    self._remember(self.compiled, pending.key, pending.future.result())
                    self._create_matcher(request_id, pending.backend, self.compiled[pending.key])
                    ready.append(request_id)
                else:
                    message = str(error) if isinstance(error, GrammarError) else f"{type(error).__name__}: {error}"
                    self._remember(self.failed, pending.key, message)
                    failed.append((request_id, message))
            elif now > pending.deadline:
                del self.pending[request_id]
                failed.append((request_id, f"grammar compilation took longer than {self.settings.compile_timeout_s:g} s"))
        return ready, failed

    @property
    def has_pending(self) -> bool:
        return bool(self.pending)

    def release(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.matchers.pop(request_id, None)

    # ------------------------------------------------------------------ per step

    def fill(self, request_ids: list[str]) -> np.ndarray:
        """Bitmask rows for these requests, in order: [len(request_ids), ceil(vocab / 32)]."""
        by_backend: dict[str, tuple[list[GrammarMatcher], list[int]]] = {}
        for row, request_id in enumerate(request_ids):
            backend, matcher = self.matchers[request_id]
            matchers, rows = by_backend.setdefault(backend, ([], []))
            matchers.append(matcher)
            rows.append(row)
        for backend, (matchers, rows) in by_backend.items():
            self.backends[backend].fill_bitmasks(matchers, self.bitmask, rows)
        return self.bitmask[: len(request_ids)]

    def accept(self, request_id: str, token: int) -> bool:
        return self.matchers[request_id][1].accept_token(token)

    def accept_forced(self, request_id: str, limit: int) -> list[int]:
        """Accept and return the tokens the grammar forces next (jump-forward)."""
        matcher = self.matchers[request_id][1]
        forced = matcher.forced_tokens(limit)
        for i, token in enumerate(forced):
            if not matcher.accept_token(token):
                return forced[:i]
        return forced

    def is_terminated(self, request_id: str) -> bool:
        return self.matchers[request_id][1].is_terminated()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ helpers

    def _compile(self, backend: str, spec: GuidedDecoding) -> Any:
        return self._backend(backend).compile(spec)

    def _backend(self, name: str) -> GrammarBackend:
        with self._backend_lock:
            if name not in self.backends:
                s = self.settings
                self.backends[name] = create_backend(name, self.tokenizer, s.vocab_size, s.stop_token_ids, s.num_threads)
            return self.backends[name]

    def _create_matcher(self, request_id: str, backend: str, compiled: Any) -> None:
        self.matchers[request_id] = (backend, self.backends[backend].create_matcher(compiled))

    def _remember(self, cache: OrderedDict[str, Any], key: str, value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self.settings.cache_size:
            cache.popitem(last=False)
