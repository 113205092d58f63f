"""Slots, the waiting queue and continuous batching.

Each step: admit waiting requests whose grammar is ready while slots are free (a slot is held for a request's
whole life), then give every running request the tokens it still has to compute, one-token
(decode) rows first, prefill chunks after them under ``max_num_batched_tokens``. A request
whose known tokens are all computed after this step wants logits for its last position.
Rows are returned in slot order, so the KV cache is read in contiguous runs.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from guidespec.scheduler.request import Request, Status


@dataclass(frozen=True)
class ScheduledRow:
    request: Request
    start: int  # first position computed this step
    num_new_tokens: int
    num_logits: int


class Batcher:
    def __init__(self, max_batch_size: int, max_num_batched_tokens: int) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.free_slots = list(range(max_batch_size))
        heapq.heapify(self.free_slots)
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
            todo = request.num_tokens - request.num_computed_tokens
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
            heapq.heappush(self.free_slots, request.slot)
            request.slot = None
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = Status.FINISHED

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def promote(self, request: Request) -> None:
        """A request whose grammar just became ready goes to the front of the queue."""
        request.grammar_ready = True
        self.waiting.remove(request)
        self.waiting.appendleft(request)

    @property
    def has_runnable_work(self) -> bool:
        return bool(self.running) or any(r.grammar_ready for r in self.waiting)

    def _admit(self) -> None:
        """Admit ready requests in queue order; UNREADY ones keep their place and block no one."""
        if not self.free_slots or not self.waiting:
            return
        still_waiting: deque[Request] = deque()
        while self.waiting:
            request = self.waiting.popleft()
            if not self.free_slots or not request.grammar_ready:
                still_waiting.append(request)
                continue
            request.slot = heapq.heappop(self.free_slots)
            request.status = Status.RUNNING
            self.running.append(request)
        self.waiting = still_waiting
