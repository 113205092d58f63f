"""Slots, blocks, the waiting queue and continuous batching.

Each step: admit waiting requests whose grammar is ready while a slot is free and the KV pool has
blocks for their first chunk, then give every running request the tokens it still has to compute,
one-token (decode) rows first, prefill chunks after them under ``max_num_batched_tokens``. A
request whose known tokens are all computed after this step wants logits for its last position.
Rows are returned in slot order. A slot names a running request's row state on the workers (its
token history, a drafter's own cache); its keys and values live in the blocks of its table
(``kv_blocks.py``), grown before each step to hold what the step writes plus ``lookahead``
positions (drafts), and sent to the workers when they change (:meth:`Batcher.table_updates`).

Out of blocks: the running request that came last is preempted (its blocks given back, its slot
freed, its known tokens, prompt and output, computed again once it is admitted again, at the
front of the queue): never an out-of-memory, never a lost request, only latency.

A grammar that still compiles does not hold its prompt back: with a slot that no ready request
waits for, the request is admitted and its prompt computed while the grammar compiles (xgrammar
on the JME schemas: 5-37 ms from submit to ready), its last token's logits included
(``late_masks``): the scheduler writes that row's mask once the grammar is ready, which is
usually before the prefill ends. Where the workers finish first, the token they sample without a
mask is dropped and the last prompt token runs again once the grammar is ready
(``Request.mask_came_late``). Without ``late_masks`` (a model drafter follows every computed
position) the request waits ``PREFILL_WHILE_COMPILING_S`` first (a grammar ready by then is
prefilled whole), and its last token always waits for the grammar.

Prefix caching (``prefix_caching``): after each step a request's blocks whose tokens are all final
are keyed by content and shared (:meth:`Batcher.commit`); a new request maps the cached blocks its
prompt starts with and starts its prefill after them. A request whose prompt's next block is
being computed by a running request (two requests with one system prompt, sent together) waits
for it instead of computing it too. The KV of a position depends only on the tokens up to it;
computed in another chunk it can differ only in float rounding (greedy outputs with and without
caching are equal in the tests). Requests with penalties do not map cached blocks (the workers'
token history restarts at a row from position 0); their blocks are shared all the same.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from guidespec.scheduler.kv_blocks import BlockPool, BlockTable, NoFreeBlocks, prefix_keys
from guidespec.scheduler.request import RUNNING, Request, Status

PREFILL_WHILE_COMPILING_S = 0.005
DEFAULT_BLOCK_SIZE = 16


class ScheduledRow(NamedTuple):
    """A request's part of a step. (A tuple: a step makes one a row, 0.36 µs where a frozen
    dataclass took 0.95: ~40 µs a step at 64 rows.)"""

    request: Request
    start: int  # first position computed this step
    num_new_tokens: int
    num_logits: int


class Batcher:
    def __init__(
        self,
        max_batch_size: int,
        max_num_batched_tokens: int,
        prefix_caching: bool = False,
        late_masks: bool = True,
        pool: BlockPool | None = None,
        lookahead: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.late_masks = late_masks
        self.free_slots = list(range(max_batch_size))
        heapq.heapify(self.free_slots)
        self.prefix_caching = prefix_caching
        # (the scheduler's is sized by the workers' pools: use_pool; this one serves tests)
        self.pool = pool or BlockPool(max_batch_size * 64, DEFAULT_BLOCK_SIZE)
        self.lookahead = lookahead  # positions reserved past a step's tokens (its drafts)
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.computing: dict[bytes, Request] = {}  # full prompt blocks running requests are computing
        self.prefix_cache_queries = self.prefix_cache_hits = self.num_preemptions = 0  # (tokens; requests)

    def use_pool(self, pool: BlockPool) -> None:
        if self.running:
            raise RuntimeError("the pool changes only while no request runs")
        self.pool = pool

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRow]:
        self._admit()
        budget = self.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        preemptions = self.num_preemptions
        pending = sorted(self.running, key=_remaining_then_arrival)
        for request in pending:
            if request.status is not RUNNING:  # preempted for an earlier row's blocks
                continue
            computed = request.num_computed_tokens
            count = min(self._computable(request) - computed, budget)
            if count <= 0:
                continue
            if not self._reserve(request, computed + count, rows):
                continue
            budget -= count
            done = computed + count == request.num_known_tokens
            rows.append(ScheduledRow(request, computed, count, 1 if done else 0))
        if self.num_preemptions != preemptions:  # (a row's request preempted for a later row's blocks)
            rows = [row for row in rows if row.request.status is RUNNING]
        rows.sort(key=_slot_of)
        return rows

    def commit(self, rows: list[ScheduledRow]) -> None:
        """After a step: the blocks its rows filled with final tokens are keyed and shared."""
        if not self.prefix_caching:
            return
        size = self.pool.block_size
        for row in rows:
            request = row.request
            table = request.blocks
            if table is None or request.status is not RUNNING:
                continue
            full = table.num_full
            if len(table.blocks) <= full or request.num_computed_tokens // size <= full:
                continue  # (most steps fill no block; asked first, before the token count)
            computed = min(request.num_computed_tokens, request.num_tokens)  # (not a pending token)
            if computed // size > full:
                table.commit(request.prompt_token_ids + request.output_token_ids, computed)

    def started(self, rows: list[ScheduledRow], step: int, run_ahead: bool) -> None:
        """A step's rows went out: their tokens (drafts aside) count as computed, so the next step
        can be planned before this one's outputs (the row of a draft rejected, or of a token
        dropped, is set back by the emit). With ``run_ahead``, a row that samples one token and
        whose request knows nothing past it makes that token pending: the next step runs it
        before the scheduler has it (``Request.pending_step``)."""
        for request, _, count, logits in rows:
            request.advance_computed(count - (logits - 1 if logits > 1 else 0))  # (drafts aside)
            if (
                run_ahead
                and logits == 1
                and request.grammar_ready
                and request.num_computed_tokens == request.num_known_tokens
            ):
                request.pending_step = step

    def table_updates(self, rows: list[ScheduledRow]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The block tables of ``rows`` that changed since the workers last had them: (slots,
        lengths, blocks), or None."""
        slots, lengths, blocks = [], [], []
        for row in rows:
            table = row.request.blocks
            if table is not None and table.changed:
                table.changed = False
                slots.append(row.request.slot)
                lengths.append(len(table.blocks))
                blocks.extend(table.blocks)
        if not slots:
            return None
        return np.array(slots, np.int32), np.array(lengths, np.int32), np.array(blocks, np.int32)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and give its slot and blocks back."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self._give_back(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = Status.FINISHED

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

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

    # ------------------------------------------------------------------ admission

    def _admit(self) -> None:
        """Admit ready requests in queue order, then (slots left) those whose grammar has compiled
        past the grace, for their prefill; the others keep their place and block no one. Admission
        stops at the first request whose first chunk the pool cannot hold (first come, first
        served); a request whose prompt's next block another request is computing waits for it."""
        if not self.free_slots or not self.waiting:
            return
        now = time.monotonic()
        out_of_blocks = False
        for admissible in (lambda r: r.grammar_ready, lambda r: self._prefills_while_compiling(r, now)):
            still_waiting: deque[Request] = deque()
            while self.waiting:
                request = self.waiting.popleft()
                if out_of_blocks or not self.free_slots or not admissible(request) or self._waits_for_prefix(request):
                    still_waiting.append(request)
                    continue
                if not self._take_blocks(request):
                    out_of_blocks = True
                    still_waiting.append(request)
                    continue
                request.slot = heapq.heappop(self.free_slots)
                request.status = Status.RUNNING
                self.running.append(request)
            self.waiting = still_waiting

    def _maps_prefix(self, request: Request) -> bool:
        return self.prefix_caching and not request.params.has_penalties

    def _take_blocks(self, request: Request) -> bool:
        """Map the cached blocks the request's tokens start with and allocate its first chunk's
        (with a block spare for each running request's next step); False, holding none, where the
        pool has too few."""
        table = BlockTable(self.pool)
        tokens = request.prompt_token_ids + request.output_token_ids
        cached = table.map_prefix(tokens, self._prompt_keys(request)) if self._maps_prefix(request) else 0
        first_chunk = min(request.num_tokens, cached + self.max_num_batched_tokens) + self.lookahead
        if table.blocks_needed(self._capped(first_chunk)) + len(self.running) > self.pool.num_free:
            table.release()
            return False
        table.grow(self._capped(first_chunk))
        request.blocks = table
        request.num_computed_tokens = cached
        if request.stats.num_preemptions == 0:  # (a preempted request's own tokens are not a prompt's)
            request.stats.num_cached_tokens = min(cached, request.num_prompt_tokens)
            self.prefix_cache_queries += request.num_prompt_tokens
            self.prefix_cache_hits += request.stats.num_cached_tokens
        if self._maps_prefix(request):
            for key in self._prompt_keys(request)[table.num_full :]:
                self.computing.setdefault(key, request)
        return True

    def _waits_for_prefix(self, request: Request) -> bool:
        """Whether the request's next uncached prompt block is one a running request computes."""
        if not self._maps_prefix(request) or not self.computing:
            return False
        for key in self._prompt_keys(request):
            if key in self.pool.by_key:
                continue
            owner = self.computing.get(key)
            return owner is not None and owner is not request and owner.status is Status.RUNNING
        return False

    def _prompt_keys(self, request: Request) -> list[bytes]:
        """The keys of the full blocks of the request's known tokens, all but the last token
        (the most a prefix maps), computed once per length."""
        tokens = request.num_tokens
        if request.prompt_keys_for != tokens:
            known = request.prompt_token_ids + request.output_token_ids
            request.prompt_keys = list(prefix_keys(known[: tokens - 1], self.pool.block_size))
            request.prompt_keys_for = tokens
        return request.prompt_keys

    # ------------------------------------------------------------------ blocks for a step

    def _capped(self, positions: int) -> int:
        return positions if self.max_model_len is None else min(positions, self.max_model_len)

    def _reserve(self, request: Request, end: int, rows: list[ScheduledRow]) -> bool:
        """Blocks for the request's positions up to ``end`` plus the lookahead, preempting the
        running requests that came last until they fit (a victim's row this step is dropped).
        False where the request itself was preempted (the last to come, and no other to take)."""
        table = request.blocks
        assert table is not None
        target = self._capped(end + self.lookahead)
        if target <= table.capacity:  # (most steps: the blocks hold it, and no grow is tried)
            return True
        while True:
            try:
                table.grow(target)
                return True
            except NoFreeBlocks:
                victim = max(self.running, key=lambda r: (r.arrival_time, r.request_id))
                self.preempt(victim)
                if victim is request:
                    return False

    def preempt(self, request: Request) -> None:
        """Send a running request back to the front of the queue, its blocks and slot given back:
        its known tokens are computed again when it is admitted again."""
        self.running.remove(request)
        self._give_back(request)
        request.status = Status.WAITING
        request.num_computed_tokens = 0
        request.pending_step = -1
        request.mask_came_late = False
        request.draft_tokens = []
        request.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _give_back(self, request: Request) -> None:
        if request.blocks is not None:
            request.blocks.release()
            request.blocks = None
        if self.computing:
            for key in [k for k, owner in self.computing.items() if owner is request]:
                del self.computing[key]
        assert request.slot is not None
        heapq.heappush(self.free_slots, request.slot)
        request.slot = None

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
        """How many of the request's tokens can be computed now: all (with the one an in-flight
        step samples, unless that one ends it at ``max_tokens`` or the model's length), or with its
        grammar still compiling and no late mask (or one that came too late already), all but
        the last (its logits need the mask)."""
        if request.pending_step >= 0:
            ends = len(request.output_token_ids) + 1 >= request.params.max_tokens or (
                self.max_model_len is not None and request.num_tokens + 1 >= self.max_model_len
            )
            return request.num_tokens if ends else request.num_tokens + 1
        if request.grammar_ready or (self.late_masks and not request.mask_came_late):
            return request.num_tokens
        return request.num_tokens - 1


def _remaining_then_arrival(request: Request) -> tuple[int, float]:
    """A running request's order in a step: fewest tokens left to compute first (decode rows
    before prefill chunks), then the first to arrive."""
    return request.num_known_tokens - request.num_computed_tokens, request.arrival_time


_slot_of = attrgetter("request.slot")
