"""Slots, the waiting queue and continuous batching.

Each step: admit waiting requests whose grammar is ready while slots are free (a slot is held for a request's
whole life), then give every running request the tokens it still has to compute, one-token
(decode) rows first, prefill chunks after them under ``max_num_batched_tokens``. A request
whose known tokens are all computed after this step wants logits for its last position.
Rows are returned in slot order, so the KV cache is read in contiguous runs.

A grammar that still compiles does not hold its prompt back: with a slot that no ready request
waits for, the request is admitted and its prompt computed while the grammar compiles (xgrammar
on the JME schemas: 5-37 ms from submit to ready), its last token's logits included
(``late_masks``): the scheduler writes that row's mask once the grammar is ready, which is
usually before the prefill ends. Where the workers finish first, the token they sample without a
mask is dropped and the last prompt token runs again once the grammar is ready
(``Request.mask_came_late``). Without ``late_masks`` (a model drafter follows every computed
position) the request waits ``PREFILL_WHILE_COMPILING_S`` first (a grammar ready by then is
prefilled whole), and its last token always waits for the grammar.

Prefix caching (``prefix_caching``): a slot given back keeps the KV of the tokens its request
computed, and a new request takes the free slot whose kept tokens share the longest prefix with
its prompt (a system prompt, a schema, an earlier turn), starting its prefill after them. The KV
of a position depends only on the tokens up to it; computed in another chunk it can differ only in
float rounding (greedy outputs with and without caching are equal in the tests). Requests with
penalties do not reuse a prefix (the workers' token history restarts at a row from position 0).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from guidespec.scheduler.request import Request, Status

PREFILL_WHILE_COMPILING_S = 0.005


@dataclass(frozen=True)
class ScheduledRow:
    request: Request
    start: int  # first position computed this step
    num_new_tokens: int
    num_logits: int


class Batcher:
    def __init__(
        self, max_batch_size: int, max_num_batched_tokens: int, prefix_caching: bool = False, late_masks: bool = True
    ) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.late_masks = late_masks
        self.free_slots = list(range(max_batch_size))
        heapq.heapify(self.free_slots)
        self.prefix_caching = prefix_caching
        self.cached: dict[int, np.ndarray] = {}  # free slot -> the tokens whose KV it still holds
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRow]:
        self._admit()
        budget = self.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        pending = sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens, r.arrival_time))
        for request in pending:
            todo = self._computable(request) - request.num_computed_tokens
            count = min(todo, budget)
            if count <= 0:
                continue
            budget -= count
            done = request.num_computed_tokens + count == request.num_tokens
            rows.append(ScheduledRow(request, request.num_computed_tokens, count, 1 if done else 0))
        rows.sort(key=lambda row: row.request.slot)  # type: ignore[arg-type, return-value]
        return rows

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and give its slot back."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
            assert request.slot is not None
            if self.prefix_caching and request.num_computed_tokens:
                known = request.prompt_token_ids + request.output_token_ids
                self.cached[request.slot] = np.asarray(known[: request.num_computed_tokens], dtype=np.int64)
            heapq.heappush(self.free_slots, request.slot)
            request.slot = None
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = Status.FINISHED

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def promote(self, request: Request) -> None:
        """A request whose grammar just became ready goes to the front of the queue (or, admitted
        already, gets its last prompt token computed)."""
        request.grammar_ready = True
        if request.status is Status.WAITING:
            self.waiting.remove(request)
            self.waiting.appendleft(request)

    @property
    def has_runnable_work(self) -> bool:
        if any(self._computable(r) > r.num_computed_tokens for r in self.running):
            return True
        if not self.free_slots:
            return False
        now = time.monotonic()
        return any(r.grammar_ready or self._prefills_while_compiling(r, now) for r in self.waiting)

    def _admit(self) -> None:
        """Admit ready requests in queue order, then (slots left) those whose grammar has compiled
        past the grace, for their prefill; the others keep their place and block no one."""
        if not self.free_slots or not self.waiting:
            return
        now = time.monotonic()
        for admissible in (lambda r: r.grammar_ready, lambda r: self._prefills_while_compiling(r, now)):
            still_waiting: deque[Request] = deque()
            while self.waiting:
                request = self.waiting.popleft()
                if not self.free_slots or not admissible(request):
                    still_waiting.append(request)
                    continue
                request.slot = self._take_slot(request)
                request.status = Status.RUNNING
                self.running.append(request)
            self.waiting = still_waiting

    def _prefills_while_compiling(self, request: Request, now: float) -> bool:
        """A request whose grammar compiles may be admitted for its prefill: at once with late
        masks, else after the grace (a grammar ready by then is prefilled whole)."""
        grace = 0.0 if self.late_masks else PREFILL_WHILE_COMPILING_S
        return (
            not request.grammar_ready
            and now - request.compiling_since >= grace
            and request.num_tokens >= (1 if self.late_masks else 2)
        )

    def _computable(self, request: Request) -> int:
        """How many of the request's tokens can be computed now: all, or with its grammar still
        compiling and no late mask (or one that came too late already), all but the last (its
        logits need the mask)."""
        if request.grammar_ready or (self.late_masks and not request.mask_came_late):
            return request.num_tokens
        return request.num_tokens - 1

    def _take_slot(self, request: Request) -> int:
        """The lowest free slot, or with prefix caching the one whose kept tokens share the longest
        prefix with the prompt (the request then starts after it; one prompt token is always left
        to compute, for the logits)."""
        best, best_len = -1, 0
        if self.prefix_caching and self.cached and not request.params.has_penalties:
            prompt = np.asarray(request.prompt_token_ids, dtype=np.int64)
            for slot in sorted(self.free_slots):  # the lowest of equals
                kept = self.cached.get(slot)
                n = 0 if kept is None else min(len(kept), len(prompt) - 1)
                if n <= best_len:
                    continue
                same = kept[:n] == prompt[:n]  # type: ignore[index]
                length = n if same.all() else int(np.argmin(same))
                if length > best_len:
                    best, best_len = slot, length
        if best_len > 0:
            self.free_slots.remove(best)
            heapq.heapify(self.free_slots)
            request.num_computed_tokens = best_len
            request.stats.num_cached_tokens = best_len
        else:
            best = heapq.heappop(self.free_slots)
        self.cached.pop(best, None)
        return best
