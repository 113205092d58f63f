"""One step's exchange with the workers: the broadcast, the bitmask, the drafts' masks, the outputs.

    send_inputs:  StepInputs on the ring (the forward starts at once)
    send_bitmask: the StepBitmask, filled while the workers compute (or held back for a grammar
                  that still compiles); with a step run ahead, after the step before was emitted
                  (the grammars then stand after its tokens)
    collect:      wait for rank 0's StepOutputs, meanwhile answering its draft steps' mask
                  requests (the draft channel, or DraftTokens messages), loading finished
                  compiles, writing a held-back bitmask, and watching the workers

The ring carries a step's inputs, then its bitmask, then the next step's inputs: a step runs ahead
only once the bitmask of the one before is written (``can_run_ahead``).

A request whose grammar is not ready when its bitmask row is due gets no row: the token the
workers sample for it is dropped (``dropped``, read by the emit) and its last prompt token runs
again once the grammar is ready.
"""

from __future__ import annotations

import logging
import time
from itertools import accumulate
from dataclasses import dataclass, field

import numpy as np

from guidespec import envs
from guidespec.config import SchedulerConfig
from guidespec.cuda_ext.channel import DONE as DRAFTS_DONE
from guidespec.cuda_ext.channel import DraftChannel, DraftChannelError
from guidespec.ipc import codec
from guidespec.ipc.broadcast import StepBroadcaster
from guidespec.ipc.waiting import AwakeTimer
from guidespec.ipc.zmq_channel import Channel
from guidespec.protocol import (
    LAST_SAMPLED,
    DraftMask,
    DraftTokens,
    MaskWanted,
    StepBitmask,
    StepInputs,
    StepNext,
    StepOutputs,
    WorkerError,
    follows_as_next,
)
from guidespec.scheduler.batching import ScheduledRow
from guidespec.scheduler.grammar import FillRow, GrammarManager
from guidespec.scheduler.health import EngineFailure, Health, worker_failure
from guidespec.scheduler.intake import Intake
from guidespec.scheduler.request import Request
from guidespec.scheduler.speculation.proposer import Speculator
from guidespec.scheduler.table import RequestTable, output_budget

logger = logging.getLogger(__name__)
IDLE_POLL_S = 0.25
COMPILE_POLL_S = 0.002  # how often an otherwise idle scheduler looks for finished compiles
# a held-back bitmask is written after this long even if rank 0 did not ask for it (``MaskWanted``)
_LATE_MASK_MAX_S = 2.0


@dataclass
class Step:
    """A step sent to the workers, until its outputs are emitted."""

    step_id: int
    rows: list[ScheduledRow]
    guided: list[tuple[int, ScheduledRow]]  # (first logits row, row) of its guided rows
    times: dict[str, float]  # its wall times, for the trace (scheduler.py)
    dropped: set[str] = field(default_factory=set)  # requests whose token is dropped (``_write_bitmask``)
    draft_fills: list[tuple[int, float, float]] = field(default_factory=list)  # (draft step, start, end)
    as_next: bool = False  # its inputs went as a StepNext
    drafted: bool = False  # planned with its drafter's drafts (``Speculator.drafted``: the draft gate)


def _follow_rows(rows: list[ScheduledRow], inputs: StepInputs) -> list[tuple[Request, int | None, int, int]]:
    """A step's rows as ``StepChannel._step_next`` checks the next step's against them."""
    return [(row.request, row.request.slot, row.start, index) for row, index in zip(rows, inputs.sample_index.tolist())]


class StepChannel:
    def __init__(
        self,
        cfg: SchedulerConfig,
        broadcaster: StepBroadcaster,
        worker_results: Channel,
        drafts: DraftChannel | None,
        grammar: GrammarManager,
        speculator: Speculator | None,
        table: RequestTable,
        intake: Intake,
        health: Health,
    ) -> None:
        self.cfg = cfg
        self.broadcaster = broadcaster
        self.worker_results = worker_results
        # rank 0's model drafts come through the draft channel (cuda_ext) where it is local
        self.drafts = drafts
        self.grammar = grammar
        self.speculator = speculator
        self.table = table
        self.intake = intake
        self.health = health
        self.step_id = 0
        self.timeout_s = envs.step_timeout_s()  # (read once: the environment's lookup costs µs a step)
        self._step_drafts = False  # the last step's rank 0 drafts (and ends with DONE on the channel)
        # the step whose bitmask waits for a grammar that compiles (``send_bitmask``)
        self._late_mask: Step | None = None
        self._late_timer = AwakeTimer(_LATE_MASK_MAX_S)
        # the last step's rows, where a StepNext may follow it: (request, slot, start, sample index)
        self._follow: list[tuple[Request, int | None, int, int]] | None = None
        self._step_next_on = envs.step_next()

    # ------------------------------------------------------------------ the broadcast

    def send_inputs(self, rows: list[ScheduledRow], start: float, run_ahead: bool = False) -> Step:
        """The step's inputs on the ring: the forward starts at once. With ``run_ahead``, a row
        that samples one token lets the next step run that token before its outputs come back
        (``Batcher.started``). Rows of unguided requests will get no bitmask row."""
        self.step_id += 1
        logits_row = list(accumulate((row.num_logits for row in rows), initial=0))
        guided = [(logits_row[i], row) for i, row in enumerate(rows) if row.num_logits and row.request.guided]
        message: StepInputs | StepNext | None = None
        if self._follow is not None:
            message = self._step_next(rows, self._follow, has_bitmask=bool(guided))
        if message is None:
            message = self._step_inputs(rows, has_bitmask=bool(guided))
            self._step_drafts = self.drafts is not None and message.draft_lens is not None
            follows = self._step_next_on and follows_as_next(message)
            self._follow = _follow_rows(rows, message) if follows else None
        self.broadcaster.write(codec.encode(message), timeout=self.timeout_s)
        self.table.batcher.started(rows, self.step_id, run_ahead)
        now = time.time()
        times = {"start": start, "inputs": now, "mask_start": now, "mask": now}
        return Step(self.step_id, rows, guided, times, as_next=isinstance(message, StepNext))

    def send_bitmask(self, step: Step) -> None:
        """The step's bitmask, filled while the workers compute; held back (``collect`` writes
        it) while a grammar of the step's last prompt tokens still compiles."""
        if not step.guided:
            return
        compiling = any(not row.request.grammar_ready for _, row in step.guided)
        if compiling and not self._step_drafts:  # (rank 0's draft steps would wait on the mask too)
            self._late_mask, self._late_timer = step, AwakeTimer(_LATE_MASK_MAX_S)
        else:
            self._write_bitmask(step)

    @property
    def can_run_ahead(self) -> bool:
        """Whether the next step's inputs may follow on the ring: the last bitmask is written."""
        return self._late_mask is None

    def _step_inputs(self, rows: list[ScheduledRow], has_bitmask: bool) -> StepInputs:
        """The step's inputs, in one pass over its rows: their integers and their floats each
        gathered as one table, whose columns are the message's arrays (64 decode rows: 75 µs,
        against 108-114 as eleven lists and arrays, one a field)."""
        token_ids: list[int] = []
        ints: list[tuple[int | None, ...]] = []  # slot, start, new tokens, logits, top_k, sample index, prompt tokens
        floats: list[tuple[float, ...]] = []  # temperature, top_p, the three penalties
        seeds: list[int] = []
        for row in rows:
            request, start, count = row.request, row.start, row.num_new_tokens
            params = request.params
            if count == 1:
                token_ids.append(request.token_at(start))
            else:
                token_ids += request.tokens(start, start + count)
            ints.append(
                (
                    request.slot,
                    start,
                    count,
                    row.num_logits,
                    params.top_k,
                    len(request.output_token_ids) + (request.pending_step >= 0),
                    len(request.prompt_token_ids),
                )
            )
            floats.append(
                (
                    params.temperature,
                    params.top_p,
                    params.repetition_penalty,
                    params.frequency_penalty,
                    params.presence_penalty,
                )
            )
            seeds.append(-1 if params.seed is None else params.seed)
        columns = np.array(ints, dtype=np.int32).reshape(-1, 7).T.copy()  # (each row of it contiguous)
        table = np.array(floats, dtype=np.float32).reshape(-1, 5)
        proposals = self.speculator.proposal_lengths(rows) if self.speculator is not None else None
        tables = self.table.batcher.table_updates(rows)
        return StepInputs(
            step=self.step_id,
            slots=columns[0],
            start_positions=columns[1],
            num_new_tokens=columns[2],
            token_ids=np.array(token_ids, dtype=np.int32),
            num_logits=columns[3],
            temperature=np.ascontiguousarray(table[:, 0]),
            top_k=columns[4],
            top_p=np.ascontiguousarray(table[:, 1]),
            seeds=np.array(seeds, dtype=np.int64),
            sample_index=columns[5],
            num_prompt_tokens=columns[6],
            penalties=np.ascontiguousarray(table[:, 2:]),
            has_bitmask=has_bitmask,
            draft_lens=proposals[0] if proposals is not None else None,
            draft_masked=proposals[1] if proposals is not None else None,
            table_slots=tables[0] if tables is not None else None,
            table_lens=tables[1] if tables is not None else None,
            table_blocks=tables[2] if tables is not None else None,
        )

    def _step_next(
        self, rows: list[ScheduledRow], follow: list[tuple[Request, int | None, int, int]], has_bitmask: bool
    ) -> StepNext | None:
        """The step as a StepNext where it follows the last one so (its rows the last step's
        requests or some of them, in the same slots and order, each one position and one sample
        on, decode rows again), else None; ``_follow`` then holds this step's rows. (At 64 rows
        the "schedule + write inputs" span 0.84 -> 0.62 ms, docs/benchmarks.md; each rank decodes
        a few hundred bytes instead of a StepInputs, 26-46 µs.)"""
        if not rows or len(rows) > len(follow):
            return None
        tokens: list[int] = []
        after: list[tuple[Request, int | None, int, int]] = []
        keep: list[int] = []  # the last step's rows that go on (a request that ended drops out)
        last_sampled = True
        j = 0
        for row in rows:
            r = row.request
            while j < len(follow) and follow[j][0] is not r:
                j += 1
            if j == len(follow):
                return None
            _, slot, start, sample_index = follow[j]
            keep.append(j)
            j += 1
            if r.slot != slot or row.start != start + 1 or row.num_new_tokens != 1:
                return None
            index = len(r.output_token_ids) + (r.pending_step >= 0)
            if row.num_logits != 1 or index != sample_index + 1:
                return None
            token = r.token_at(row.start)
            last_sampled = last_sampled and token == LAST_SAMPLED
            tokens.append(token)
            after.append((r, slot, row.start, index))
        self._follow, self._step_drafts = after, False  # (no drafts: the step before wanted none)
        slots, lens, blocks = self.table.batcher.table_updates(rows) or (None, None, None)
        return StepNext(
            self.step_id,
            None if last_sampled else np.array(tokens, dtype=np.int32),
            has_bitmask,
            slots,
            lens,
            blocks,
            None if len(keep) == len(follow) else np.array(keep, dtype=np.int32),
        )

    def _write_bitmask(self, step: Step) -> None:
        """Fill the step's bitmask rows and write them. A request whose grammar is still not ready
        gets no row: the token the workers sample for it without a mask is dropped (``emit``), and
        its last prompt token runs again once the grammar is ready. A request that ended since
        the step went out (the step before finished it) gets none either: its sample is unused."""
        self._late_mask = None
        step.times["mask_start"] = time.time()
        fills: list[FillRow] = []
        rows: list[int] = []  # the bitmask's logits rows
        held, closes, max_model_len = self.table.requests, self.grammar.budget_tracked, self.cfg.max_model_len
        for first, row in step.guided:  # (one pass: 64 regex rows' 71-80 µs alone as three, 33-37 as one)
            request = row.request
            request_id = request.request_id
            if held.get(request_id) is not request:
                continue
            if not request.grammar_ready:
                step.dropped.add(request_id)
                continue
            if request_id in closes:  # (the others' budgets are unused: ``FillRow``)
                budget = output_budget(request, max_model_len)
                fills.append(FillRow(request_id, request.draft_tokens, len(request.output_token_ids), budget))
            else:
                fills.append(FillRow(request_id, request.draft_tokens))
            rows.extend(range(first, first + row.num_logits))
        bitmask = self._fill(fills, self.broadcaster.reserve_bitmask())
        for request_id, reason in self.grammar.take_failures():  # (their rows allow only a stop token)
            if request_id in self.table.requests:
                self.table.grammar_failed(self.table.requests[request_id], reason)
        rows_array = np.array(rows, dtype=np.int32)
        if self.cfg.fused_steps and self._step_drafts:  # rank 0 may run the step as one graph (step_graph.py)
            assert self.drafts is not None
            self.drafts.answer_verify(step.step_id, rows_array, bitmask)
        self.broadcaster.write_bitmask(StepBitmask(step.step_id, rows_array, bitmask), timeout=self.timeout_s)
        step.times["mask"] = time.time()

    def _fill(self, rows: list[FillRow], out: np.ndarray | None) -> np.ndarray:
        """The step's bitmask, in ``out`` (the mask arena's next buffer) where it fits. If a grammar
        raises, the rows are filled one request at a time to find it: that request fails, and its
        rows allow only a stop token (its tokens are dropped)."""
        try:
            return self.grammar.fill(rows, out)
        except Exception:
            logger.exception("step %d: a grammar failed while filling the bitmask", self.step_id)
        parts = []
        for row in rows:
            try:
                parts.append(self.grammar.fill([row]).copy())
            except Exception as e:
                parts.append(self.grammar.stop_rows(1 + len(row.drafts)))
                self.table.fail_internal(self.table.requests[row.request_id], "filling its grammar's mask", e)
        return np.concatenate(parts)

    # ------------------------------------------------------------------ the collection

    def collect(self, step: Step) -> StepOutputs:
        """Wait for rank 0's outputs of ``step``, answering its draft steps' mask requests and
        watching the workers while waiting."""
        try:
            return self._collect(step)
        finally:
            self.grammar.end_draft_walk()  # (the draft steps' masks walked the grammars)

    def _collect(self, step: Step) -> StepOutputs:
        timer = AwakeTimer(self.timeout_s)  # running time: a pause of the whole engine is no hang
        early = self._serve_drafts(step, timer) if self._step_drafts and step.step_id == self.step_id else None
        while True:
            compiling = self.grammar.has_pending
            timeout = COMPILE_POLL_S if compiling else IDLE_POLL_S
            message = early if early is not None else self.worker_results.recv(timeout_s=timeout)
            early = None
            if isinstance(message, StepOutputs) and message.step == step.step_id:
                step.times["outputs"] = time.time()
                return message
            if isinstance(message, DraftTokens) and message.step == step.step_id:
                self._send_draft_mask(message, step.rows)
            if isinstance(message, WorkerError):
                raise EngineFailure(worker_failure(message))
            if compiling:
                self.intake.take_compiled()
            late = self._late_mask
            if late is not None and (
                all(row.request.grammar_ready for _, row in late.guided)
                or (isinstance(message, MaskWanted) and message.step == late.step_id)
                or self._late_timer.expired()
            ):
                self._write_bitmask(late)
            if message is None:
                self.health.check()
                if timer.expired():
                    raise EngineFailure(f"step {step.step_id}: workers gave no result in {self.timeout_s:.0f} s")

    # ------------------------------------------------------------------ the draft steps' masks

    def _serve_drafts(self, step: Step, timer: AwakeTimer) -> object | None:
        """Answer rank 0's draft steps through the draft channel until it says it is done; returns
        a message from the workers that came meanwhile (their error), if one did."""
        assert self.drafts is not None
        last, rank0 = -1, self.health.worker_pids.get(0, 0)
        while True:
            try:
                got = self.drafts.next_drafts(self.step_id, last, IDLE_POLL_S, rank0)
            except DraftChannelError as e:
                raise EngineFailure(f"worker rank 0's drafts: {e}") from None
            if got is None:  # nothing yet: is everyone alive, has a worker failed?
                message = self.worker_results.recv(timeout_s=0)
                if message is not None:
                    return message
                self.health.check()
                if timer.expired():
                    raise EngineFailure(f"step {self.step_id}: rank 0 drafted nothing in {self.timeout_s:.0f} s")
                continue
            index, batch_rows, sequences = got
            if index == DRAFTS_DONE:
                return None
            start = time.time()
            self.drafts.answer(self.step_id, index, self._draft_mask_rows(batch_rows, sequences, step.rows))
            step.draft_fills.append((index, start, time.time()))
            last = index

    def _draft_mask_rows(
        self, batch_rows: np.ndarray, sequences: list[list[int]], rows: list[ScheduledRow]
    ) -> np.ndarray:
        """The mask rows of a draft step: each drafting row's grammar after its sequence."""
        return self.grammar.fill_after([rows[b].request.request_id for b in batch_rows.tolist()], sequences)

    def _send_draft_mask(self, message: DraftTokens, rows: list[ScheduledRow]) -> None:
        """A draft step through messages (rank 0 remote, or GUIDESPEC_DRAFT_CHANNEL=python)."""
        sequences = split(message.token_ids, message.num_tokens)
        assert sequences is not None
        bitmask = self._draft_mask_rows(message.rows, sequences, rows)
        self.broadcaster.write(
            codec.encode(DraftMask(message.step, message.draft_index, bitmask)), timeout=self.timeout_s
        )


def split(flat: np.ndarray | None, counts: np.ndarray | None) -> list[list[int]] | None:
    """Per-row lists from a flat array and its per-row counts."""
    if flat is None or counts is None:
        return None
    ends = np.cumsum(counts).tolist()
    return [flat[end - n : end].tolist() for end, n in zip(ends, counts.tolist())]
