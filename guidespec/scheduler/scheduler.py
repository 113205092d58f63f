"""The scheduler process: its loop, start to end.

    wait for workers and the grammar compile process -> EngineReady ->
    loop: receive -> poll grammars -> schedule -> [plan drafts] -> broadcast (inputs, then bitmasks)
          -> collect (answering draft-step mask requests) -> emit

It owns every request's state (and, with guided decoding, every grammar). Workers see only
StepInputs on the shared-memory ring; rank 0 answers with StepOutputs over ZeroMQ. A worker
that reports an error or whose process disappears fails every request with a message naming
it, and the scheduler tells the client the engine is dead instead of hanging.

Failures that concern one request (its input, its grammar, its drafter, its detokenizer) fail
that request alone, with a one-line message and a status saying whose fault it is; the
traceback goes to this process's log. A grammar that stops before its output is complete (a
backend's limit met mid-way) fails its request with ``GRAMMAR_FAILED``, or starts it again on
the next backend of "auto" while none of its output has reached the client.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from guidespec import envs
from guidespec.config import MODEL_DRAFTERS, SchedulerConfig, SpeculativeConfig
from guidespec.ipc import codec
from guidespec.ipc.broadcast import StepBroadcaster
from guidespec.ipc.shm_ring import RingTimeout
from guidespec.ipc.waiting import AwakeTimer
from guidespec.ipc.zmq_channel import Channel
from guidespec.process_utils import parent_alive, setup_child_process
from guidespec.grammar_backends import GrammarError
from guidespec.protocol import (
    BAD_REQUEST,
    ENGINE_UNAVAILABLE,
    GRAMMAR_FAILED,
    INTERNAL_ERROR,
    NO_TOKEN,
    AbortRequest,
    DraftMask,
    DraftTokens,
    EngineDead,
    EngineReady,
    GenerateRequest,
    GuidedDecoding,
    InvalidRequest,
    MaskWanted,
    RequestOutput,
    RequestOutputs,
    SchedulerStats,
    Shutdown,
    StepBitmask,
    StepInputs,
    StepOutputs,
    WorkerError,
    WorkerReady,
    validate_request,
)
from guidespec.cuda_ext.channel import DONE as DRAFTS_DONE
from guidespec.cuda_ext.channel import DraftChannel, DraftChannelError
from guidespec.scheduler.batching import Batcher, ScheduledRow
from guidespec.scheduler.detokenizer import IncrementalDetokenizer
from guidespec.scheduler.grammar import CompileProcess, FillRow, GrammarManager, grammar_settings
from guidespec.scheduler.output import append_token, finish_output, make_delta
from guidespec.scheduler.request import Request
from guidespec.scheduler.trace import StepTrace
from guidespec.model_files import load_tokenizer
from guidespec.scheduler.speculation.proposer import Speculator

logger = logging.getLogger(__name__)
_IDLE_POLL_S = 0.25
_COMPILE_POLL_S = 0.002  # how often an otherwise idle scheduler looks for finished compiles
# a held-back bitmask is written after this long even if rank 0 did not ask for it (``MaskWanted``)
_LATE_MASK_MAX_S = 2.0
_STATS_INTERVAL_S = 0.1  # SchedulerStats to the client at most this often


class EngineFailure(RuntimeError):
    """The workers can no longer serve: every request fails with this message."""


def run_scheduler(cfg: SchedulerConfig, parent_pid: int, compile_process: CompileProcess | None = None) -> None:
    """Process entry point (``compile_process``: see ``GrammarManager``)."""
    setup_child_process("scheduler")
    scheduler = Scheduler(cfg, parent_pid, compile_process)
    try:
        scheduler.start()
        scheduler.run()
    except EngineFailure as e:
        scheduler.fail_all(str(e))
    finally:
        scheduler.close()


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, parent_pid: int, compile_process: CompileProcess | None = None) -> None:
        self.cfg = cfg
        self.parent_pid = parent_pid
        self.tokenizer = load_tokenizer(cfg.model_dir)
        self.ctx = zmq.Context()
        self.client_in = Channel(self.ctx, zmq.PULL, cfg.client_in, bind=True)
        self.client_out = Channel(self.ctx, zmq.PUSH, cfg.client_out, bind=False)
        self.worker_results = Channel(self.ctx, zmq.PULL, cfg.worker_results, bind=True)
        self.broadcaster = StepBroadcaster(cfg.broadcast, self.ctx)
        # rank 0's model drafts come through the draft channel (cuda_ext) where it is local
        self.drafts = DraftChannel.attach(cfg.draft_channel) if cfg.draft_channel is not None else None
        self._step_drafts = False  # this step's rank 0 drafts (and ends with DONE on the channel)
        # prefix caching needs every cache a step writes to follow the target's: not with a draft
        # model or an EAGLE head (their caches follow lazily)
        model_drafter = cfg.speculative is not None and cfg.speculative.method in MODEL_DRAFTERS
        # (a model drafter follows every position computed: a prompt's last token is not run twice)
        self.batcher = Batcher(
            cfg.max_batch_size,
            cfg.max_num_batched_tokens,
            cfg.enable_prefix_caching and not model_drafter,
            late_masks=not model_drafter,
        )
        self.grammar = GrammarManager(grammar_settings(cfg), self.tokenizer, compile_process)
        self.requests: dict[str, Request] = {}
        self.worker_pids: dict[int, int] = {}
        self.step_id = 0
        self.stopping = False
        self.times: dict[str, float] = {}
        self.trace = StepTrace()
        self.draft_fills: list[tuple[int, float, float]] = []  # this step's draft masks: (draft step, start, end)
        self._failed_compiles: list[tuple[str, str]] = []  # (request, error) seen while a step ran
        self._restarts: list[_Restart] = []  # requests whose grammar failed, to start again after the step
        # this step's guided rows while its bitmask waits for a grammar that compiles (``broadcast``)
        self._late_mask: list[tuple[int, ScheduledRow]] | None = None
        self._late_timer = AwakeTimer(_LATE_MASK_MAX_S)
        self._dropped: set[str] = set()  # requests whose token this step is dropped (``_write_bitmask``)
        # verified jump-forward without a drafter: the grammar's forced tokens alone, as drafts
        speculative = cfg.speculative
        if speculative is None and cfg.jump_forward == "verified":
            speculative = SpeculativeConfig(method="forced", adaptive=False)
        self.speculator = (
            Speculator(
                speculative,
                self.grammar,
                cfg.max_model_len,
                self.tokenizer,
                cfg.vocab_size,
                jump_forward=cfg.jump_forward == "verified",
            )
            if speculative
            else None
        )
        self._stats: SchedulerStats | None = None
        self._stats_sent_at = 0.0

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        deadline = time.monotonic() + envs.worker_start_timeout_s()
        while len(self.worker_pids) < self.cfg.num_workers:
            message = self.worker_results.recv(timeout_s=_IDLE_POLL_S)
            if isinstance(message, WorkerReady):
                self.worker_pids[message.rank] = message.pid
            elif isinstance(message, WorkerError):
                raise EngineFailure(_worker_failure(message))
            if time.monotonic() > deadline:
                raise EngineFailure(f"workers did not start within {envs.worker_start_timeout_s():.0f} s")
            if not parent_alive(self.parent_pid):
                raise EngineFailure("the client process is gone")
        try:
            self.broadcaster.wait_for_readers(max(1.0, deadline - time.monotonic()))
        except RingTimeout as e:
            raise EngineFailure(str(e)) from None
        if not self.grammar.wait_started(max(1.0, deadline - time.monotonic())):
            logger.warning("the grammar compile process is not ready yet; guided requests will wait for it")
        self.client_out.send(EngineReady(self.cfg.num_workers, self.cfg.max_batch_size, self.cfg.max_model_len))

    def run(self) -> None:
        while not self.stopping:
            self.receive()
            self.poll_grammars()
            self.send_stats()
            self.times["start"] = time.time()
            rows = self.batcher.schedule()
            if not rows:
                continue
            if self.speculator is not None:
                rows = self._plan_drafts(rows)
                if not rows:
                    continue
            guided_rows = self.broadcast(rows)
            outputs = self.collect(rows)
            self.times["outputs"] = time.time()
            self.emit(rows, outputs)
            self.times["end"] = time.time()
            if outputs.timings is not None:
                self.trace.record(
                    self.step_id,
                    self.times,
                    outputs.timings,
                    len(rows),
                    guided_rows,
                    outputs.draft_s,
                    sum(row.num_new_tokens for row in rows),
                    self.draft_fills,
                    outputs.fused,
                    outputs.mask_waits,
                )

    def send_stats(self) -> None:
        """The queue's figures to the client when they change (at most every 0.1 s)."""
        now = time.monotonic()
        if now - self._stats_sent_at < _STATS_INTERVAL_S:
            return
        compiling = sum(1 for r in self.batcher.waiting if not r.grammar_ready)  # (running ones count as running)
        stats = SchedulerStats(
            len(self.batcher.running), len(self.batcher.waiting) - compiling, compiling, len(self.batcher.free_slots)
        )
        if stats != self._stats:
            self.client_out.send(stats)
            self._stats, self._stats_sent_at = stats, now

    def close(self) -> None:
        for channel in (self.client_in, self.client_out, self.worker_results):
            channel.close()
        self.grammar.shutdown()
        trace_path = envs.trace_path()
        if trace_path:
            self.trace.write(Path(trace_path))
        self.broadcaster.close()
        if self.drafts is not None:
            self.drafts.close()
        self.ctx.term()

    # ------------------------------------------------------------------ the step

    def receive(self) -> None:
        """Take in client messages: wait for one while idle, drain without waiting otherwise."""
        if self.batcher.has_runnable_work:
            timeout = 0.0
        else:
            timeout = _COMPILE_POLL_S if self.grammar.has_pending else _IDLE_POLL_S
        message = self.client_in.recv(timeout_s=timeout)
        while message is not None:
            self._handle_client_message(message)
            message = self.client_in.recv_nowait()
        if not self.batcher.has_work:
            self._check_health()

    def poll_grammars(self) -> None:
        """Move requests whose grammar compiled to the front of the queue; fail those that did not
        (also those whose compile failed while a step ran)."""
        self._take_compiled()
        failed, self._failed_compiles = self._failed_compiles, []
        for request_id, error in failed:
            if request_id in self.requests:
                self._fail(self.requests[request_id], error, BAD_REQUEST)
        restarts, self._restarts = self._restarts, []
        for restart in restarts:
            self._start_again(restart)

    def _take_compiled(self) -> None:
        """Ready the requests whose grammar compiled (``collect`` calls it too: a compile that ends
        while the workers compute a step, as a prompt's prefill, is loaded and checked meanwhile,
        not after the step); failures wait for ``poll_grammars``, between steps."""
        ready, failed = self.grammar.poll()
        self._failed_compiles.extend(failed)
        for request_id in ready:
            request = self.requests[request_id]
            request.grammar_backend, request.grammar_refusal = self.grammar.served(request_id)
            self.batcher.promote(request)
            self._prepare_grammar(request)

    def _prepare_grammar(self, request: Request) -> None:
        """The grammar's work for the request's first mask that needs no step (the first dry run
        of closing), done as soon as its matcher exists rather than in the first step's fill."""
        try:
            self.grammar.prepare(request.request_id, self._output_budget(request))
        except Exception:  # the first fill does it again and fails the request there if it must
            logger.exception("request %s: preparing its grammar failed", request.request_id)

    def broadcast(self, rows: list[ScheduledRow]) -> int:
        """Two broadcasts: the inputs first, so the forward starts at once; then the bitmasks,
        filled while the workers compute. Rows of unguided requests get no bitmask row. A step
        with the last prompt token of a request whose grammar still compiles holds its bitmask
        back for ``collect`` to write (``_late_mask``)."""
        self.step_id += 1
        logits_row = np.cumsum([0] + [row.num_logits for row in rows])
        guided = [(int(logits_row[i]), row) for i, row in enumerate(rows) if row.num_logits and row.request.guided]
        inputs = self._step_inputs(rows, has_bitmask=bool(guided))
        self._step_drafts = self.drafts is not None and inputs.draft_lens is not None
        self.draft_fills.clear()
        self._dropped.clear()
        self.broadcaster.write(codec.encode(inputs), timeout=envs.step_timeout_s())
        self.times["inputs"] = self.times["mask_start"] = self.times["mask"] = time.time()
        compiling = any(not row.request.grammar_ready for _, row in guided)
        if compiling and not self._step_drafts:  # (rank 0's draft steps would wait on the mask too)
            self._late_mask, self._late_timer = guided, AwakeTimer(_LATE_MASK_MAX_S)
        elif guided:
            self._write_bitmask(guided)
        return len(guided)

    def _write_bitmask(self, guided: list[tuple[int, ScheduledRow]]) -> None:
        """Fill the step's bitmask rows and write them. A request whose grammar is still not ready
        gets no row: the token the workers sample for it without a mask is dropped (``emit``), and
        its last prompt token runs again once the grammar is ready."""
        self._late_mask = None
        self.times["mask_start"] = time.time()
        masked = []
        for first, row in guided:
            if row.request.grammar_ready:
                masked.append((first, row))
            else:
                self._dropped.add(row.request.request_id)
        bitmask = self._fill(
            [
                FillRow(
                    row.request.request_id,
                    row.request.draft_tokens,
                    len(row.request.output_token_ids),
                    self._output_budget(row.request),
                )
                for _, row in masked
            ],
            self.broadcaster.reserve_bitmask(),
        )
        for request_id, reason in self.grammar.take_failures():  # (their rows allow only a stop token)
            if request_id in self.requests:
                self._grammar_failed(self.requests[request_id], reason)
        rows_array = np.array(
            [r for first, row in masked for r in range(first, first + row.num_logits)], dtype=np.int32
        )
        if self.cfg.fused_steps and self._step_drafts:  # rank 0 may run the step as one graph (step_graph.py)
            assert self.drafts is not None
            self.drafts.answer_verify(self.step_id, rows_array, bitmask)
        self.broadcaster.write_bitmask(StepBitmask(self.step_id, rows_array, bitmask), timeout=envs.step_timeout_s())
        self.times["mask"] = time.time()

    def collect(self, rows: list[ScheduledRow]) -> StepOutputs:
        """Wait for rank 0's outputs for this step, answering its draft steps' mask requests and
        watching the workers while waiting."""
        try:
            return self._collect(rows)
        finally:
            self.grammar.end_draft_walk()  # (the draft steps' masks walked the grammars)

    def _collect(self, rows: list[ScheduledRow]) -> StepOutputs:
        timer = AwakeTimer(envs.step_timeout_s())  # running time: a pause of the whole engine is no hang
        early = self._serve_drafts(rows, timer) if self._step_drafts else None
        while True:
            compiling = self.grammar.has_pending
            timeout = _COMPILE_POLL_S if compiling else _IDLE_POLL_S
            message = early if early is not None else self.worker_results.recv(timeout_s=timeout)
            early = None
            if isinstance(message, StepOutputs) and message.step == self.step_id:
                return message
            if isinstance(message, DraftTokens) and message.step == self.step_id:
                self._send_draft_mask(message, rows)
            if isinstance(message, WorkerError):
                raise EngineFailure(_worker_failure(message))
            if compiling:
                self._take_compiled()
            if self._late_mask is not None and (
                all(row.request.grammar_ready for _, row in self._late_mask)
                or (isinstance(message, MaskWanted) and message.step == self.step_id)
                or self._late_timer.expired()
            ):
                self._write_bitmask(self._late_mask)
            if message is None:
                self._check_health()
                if timer.expired():
                    raise EngineFailure(f"step {self.step_id}: workers gave no result in {envs.step_timeout_s():.0f} s")

    def emit(self, rows: list[ScheduledRow], outputs: StepOutputs) -> None:
        offsets = np.concatenate([[0], np.cumsum(outputs.num_tokens)])
        proposals = _split(outputs.draft_tokens, outputs.num_draft_tokens)
        now = time.time()
        if self.speculator is not None:
            proposed = outputs.num_draft_tokens  # (a fused step times its draft steps apart too)
            self.speculator.observe_step(
                sum(row.num_new_tokens for row in rows),
                outputs.forward_s,
                proposed.tolist() if proposed is not None else None,
                outputs.draft_s,
            )
        deltas: list[RequestOutput] = []  # one message for the step's deltas: one send, not one per request
        try:
            self._emit_rows(rows, outputs, offsets, proposals, now, deltas)
        finally:
            if deltas:
                self.client_out.send(RequestOutputs(deltas))

    def _emit_rows(
        self,
        rows: list[ScheduledRow],
        outputs: StepOutputs,
        offsets: np.ndarray,
        proposals: list[list[int]] | None,
        now: float,
        deltas: list[RequestOutput],
    ) -> None:
        for i, row in enumerate(rows):
            if self.requests.get(row.request.request_id) is not row.request:  # failed during this step
                continue
            if row.request.request_id in self._dropped:  # sampled without its mask: that token runs again
                row.request.advance_computed(row.num_new_tokens - row.num_logits)
                row.request.mask_came_late = True
                continue
            new_tokens = outputs.token_ids[offsets[i] : offsets[i + 1]].tolist()
            if NO_TOKEN in new_tokens:
                self._fail(
                    row.request,
                    "the grammar allows no token of the model's vocabulary here (it asks for "
                    "text the tokenizer cannot produce)",
                    BAD_REQUEST,
                )
                continue
            try:
                self._emit_row(row, new_tokens, proposals[i] if proposals is not None else None, now, deltas)
            except Exception as e:
                self._fail_internal(row.request, "emitting its tokens", e)

    def _emit_row(
        self,
        row: ScheduledRow,
        new_tokens: list[int],
        proposal: list[int] | None,
        now: float,
        deltas: list[RequestOutput],
    ) -> None:
        """Append one row's tokens to its request (its grammar, detokenizer, stop checks), then
        add the request's delta to the step's."""
        request = row.request
        num_drafts = row.num_logits - 1 if row.num_logits else 0
        accepted = max(0, len(new_tokens) - 1)
        request.advance_computed(row.num_new_tokens - num_drafts)
        if self.speculator is not None:
            self.speculator.observe(request, num_drafts, accepted)
        if not new_tokens or request.finished:
            return
        request.stats.record_step(num_drafts, accepted)
        if not request.output_token_ids:
            request.first_token_time = now
        reason, appended = self._append_all(request, new_tokens)
        # accepted drafts are in the KV cache now; rejected drafts' entries get overwritten later
        request.advance_computed(min(accepted, appended))
        if proposal is not None and self.speculator is not None and appended == len(new_tokens):
            self.speculator.store_proposals(request, proposal)
        if (
            reason is None
            and request.guided
            and self.cfg.jump_forward == "unverified"
            and not self._speculates(request)
        ):
            reason = self._jump_forward(request)
        if reason is None and request.guided and self.cfg.jump_forward != "off":
            end = self.grammar.end_token(request.request_id)  # a complete output ends here, not in a step
            if end is not None:
                reason = self._append(request, end)
        if reason == "error" or (reason is None and not request.stream):  # (the finished output comes whole)
            return
        delta = make_delta(request, reason)
        deltas.append(delta)
        if delta.finished:
            self._forget(request)

    def _serve_drafts(self, rows: list[ScheduledRow], timer: AwakeTimer) -> object | None:
        """Answer rank 0's draft steps through the draft channel until it says it is done; returns
        a message from the workers that came meanwhile (their error), if one did."""
        assert self.drafts is not None
        last, rank0 = -1, self.worker_pids.get(0, 0)
        while True:
            try:
                got = self.drafts.next_drafts(self.step_id, last, _IDLE_POLL_S, rank0)
            except DraftChannelError as e:
                raise EngineFailure(f"worker rank 0's drafts: {e}") from None
            if got is None:  # nothing yet: is everyone alive, has a worker failed?
                message = self.worker_results.recv(timeout_s=0)
                if message is not None:
                    return message
                self._check_health()
                if timer.expired():
                    raise EngineFailure(f"step {self.step_id}: rank 0 drafted nothing in {envs.step_timeout_s():.0f} s")
                continue
            index, batch_rows, sequences = got
            if index == DRAFTS_DONE:
                return None
            start = time.time()
            self.drafts.answer(self.step_id, index, self._draft_mask_rows(batch_rows, sequences, rows))
            self.draft_fills.append((index, start, time.time()))
            last = index

    def _draft_mask_rows(
        self, batch_rows: np.ndarray, sequences: list[list[int]], rows: list[ScheduledRow]
    ) -> np.ndarray:
        """The mask rows of a draft step: each drafting row's grammar after its sequence."""
        return self.grammar.fill_after([rows[b].request.request_id for b in batch_rows.tolist()], sequences)

    def _send_draft_mask(self, message: DraftTokens, rows: list[ScheduledRow]) -> None:
        """A draft step through messages (rank 0 remote, or GUIDESPEC_DRAFT_CHANNEL=python)."""
        sequences = _split(message.token_ids, message.num_tokens)
        assert sequences is not None
        bitmask = self._draft_mask_rows(message.rows, sequences, rows)
        self.broadcaster.write(
            codec.encode(DraftMask(message.step, message.draft_index, bitmask)), timeout=envs.step_timeout_s()
        )

    def _speculates(self, request: Request) -> bool:
        return self.speculator is not None and self.speculator.speculates(request)

    def _append_all(self, request: Request, tokens: list[int]) -> tuple[str | None, int]:
        """Append a step's tokens until one finishes the request: (finish reason, tokens appended)."""
        for count, token in enumerate(tokens, start=1):
            reason = self._append(request, token)
            if reason is not None:
                return reason, count
        return None, len(tokens)

    def _append(self, request: Request, token: int) -> str | None:
        """Advance the request (and its grammar) by one token; the finish reason, if any."""
        grammar_done = False
        if request.guided:
            if not self.grammar.accept(request.request_id, token):
                failure = self.grammar.error(request.request_id)
                if failure:
                    self._grammar_failed(request, failure)
                else:
                    self._fail(request, f"internal error: the grammar rejected sampled token {token}")
                return "error"
            grammar_done = self.grammar.is_terminated(request.request_id)
            self.grammar.near_budget(
                request.request_id, self._output_budget(request), len(request.output_token_ids) + 1
            )
        return append_token(request, token, self.cfg.eos_token_ids, self.cfg.max_model_len, grammar_done)

    def _output_budget(self, request: Request) -> int:
        """Output tokens the request can have: max_tokens, or less where the model length ends first
        (a JSON output then starts closing in time, as it does before max_tokens)."""
        return min(request.params.max_tokens, self.cfg.max_model_len - request.num_prompt_tokens)

    def _jump_forward(self, request: Request) -> str | None:
        """Append the tokens the grammar forces; the next step computes them with no sampling."""
        limit = self._output_budget(request) - len(request.output_token_ids)
        forced = self.grammar.accept_forced(request.request_id, limit)
        terminated = bool(forced) and self.grammar.is_terminated(request.request_id)
        for i, token in enumerate(forced):
            last = i == len(forced) - 1
            reason = append_token(request, token, self.cfg.eos_token_ids, self.cfg.max_model_len, last and terminated)
            if reason is not None:
                return reason
        return None

    # ------------------------------------------------------------------ helpers

    def _step_inputs(self, rows: list[ScheduledRow], has_bitmask: bool) -> StepInputs:
        token_ids = [t for row in rows for t in row.request.tokens(row.start, row.start + row.num_new_tokens)]
        params = [row.request.params for row in rows]
        proposals = self.speculator.proposal_lengths(rows) if self.speculator is not None else None
        return StepInputs(
            step=self.step_id,
            slots=np.array([row.request.slot for row in rows], dtype=np.int32),
            start_positions=np.array([row.start for row in rows], dtype=np.int32),
            num_new_tokens=np.array([row.num_new_tokens for row in rows], dtype=np.int32),
            token_ids=np.array(token_ids, dtype=np.int32),
            num_logits=np.array([row.num_logits for row in rows], dtype=np.int32),
            temperature=np.array([p.temperature for p in params], dtype=np.float32),
            top_k=np.array([p.top_k for p in params], dtype=np.int32),
            top_p=np.array([p.top_p for p in params], dtype=np.float32),
            seeds=np.array([-1 if p.seed is None else p.seed for p in params], dtype=np.int64),
            sample_index=np.array([len(row.request.output_token_ids) for row in rows], dtype=np.int32),
            num_prompt_tokens=np.array([row.request.num_prompt_tokens for row in rows], dtype=np.int32),
            penalties=np.array(
                [(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in params], dtype=np.float32
            ).reshape(-1, 3),
            has_bitmask=has_bitmask,
            draft_lens=proposals[0] if proposals is not None else None,
            draft_masked=proposals[1] if proposals is not None else None,
        )

    def _handle_client_message(self, message: Any) -> None:
        if isinstance(message, GenerateRequest):
            try:
                self._add_request(message)
            except Exception:
                logger.exception("request %s could not be added", message.request_id)
                self._forget_id(message.request_id)
                self.client_out.send(
                    RequestOutput(
                        message.request_id,
                        [],
                        "",
                        True,
                        "error",
                        "internal error while adding the request",
                        error_status=INTERNAL_ERROR,
                    )
                )
        elif isinstance(message, AbortRequest):
            request = self.requests.get(message.request_id)
            if request is not None:
                self.client_out.send(finish_output(request, "abort"))
                self._forget(request)
            restarting = [r for r in self._restarts if r.request.request_id == message.request_id]
            for restart in restarting:  # (between its grammar's failure and its new start)
                self._restarts.remove(restart)
                self.client_out.send(finish_output(restart.request, "abort"))
        elif isinstance(message, Shutdown):
            self.stopping = True
            try:
                self.broadcaster.write(codec.encode(Shutdown(message.reason)), timeout=2.0)
            except RingTimeout:
                logger.warning("a worker did not take the shutdown message; the launcher will stop it")
        else:
            logger.warning("ignoring unexpected %s from the client", type(message).__name__)

    def _add_request(self, message: GenerateRequest) -> None:
        prompt = message.prompt_token_ids.tolist() if isinstance(message.prompt_token_ids, np.ndarray) else []
        error = self._validate(message, prompt)
        if error is not None:
            self.client_out.send(
                RequestOutput(message.request_id, [], "", True, "error", error, error_status=BAD_REQUEST)
            )
            return
        request = Request(
            message.request_id,
            prompt,
            message.params,
            message.arrival_time,
            IncrementalDetokenizer(self.tokenizer, prompt),
            stream=message.stream,
        )
        if message.params.guided is not None:
            try:
                request.compiling_since = time.monotonic()
                request.grammar_ready = self.grammar.submit(request.request_id, message.params.guided)
                if request.grammar_ready:
                    request.grammar_backend, request.grammar_refusal = self.grammar.served(request.request_id)
            except GrammarError as e:
                self.client_out.send(
                    RequestOutput(message.request_id, [], "", True, "error", str(e), error_status=BAD_REQUEST)
                )
                return
        self.requests[request.request_id] = request
        self.batcher.add(request)

    def _validate(self, message: GenerateRequest, prompt: list[int]) -> str | None:
        """The client validated the request already (the same ``validate_request``): this is the
        engine's own guard, for a client that did not."""
        if message.request_id in self.requests:
            return f"request id {message.request_id!r} is already in use"
        try:
            validate_request(prompt, message.params, self.cfg.vocab_size, self.cfg.max_model_len)
        except InvalidRequest as e:
            return str(e)
        return None

    def _forget(self, request: Request) -> None:
        self.batcher.remove(request)
        self.grammar.release(request.request_id)
        if self.speculator is not None:
            self.speculator.release(request.request_id)
        self.requests.pop(request.request_id, None)

    def _fail(self, request: Request, error: str, status: int = INTERNAL_ERROR, code: str = "") -> None:
        """End one request with an error; the others carry on."""
        try:
            output = _error_output(request, error, status, code)
        except Exception:  # its detokenizer is what failed: end it without the last text
            logger.exception("request %s: its last output could not be made", request.request_id)
            output = RequestOutput(
                request.request_id, [], "", True, "error", error, error_status=status, error_code=code
            )
        self.client_out.send(output)
        self._forget(request)

    def _grammar_failed(self, request: Request, reason: str) -> None:
        """The request's grammar stopped before its output was complete (``reason`` names the
        backend and why): never an end. With backend "auto" and another backend left, a request
        none of whose output has reached the client (it does not stream, or nothing went out
        yet) starts again on that backend, after this step; any other fails with
        ``GRAMMAR_FAILED``. The rest of the batch is not touched."""
        guided, backends, refusals = self.grammar.alternatives.get(request.request_id, (None, [], []))
        sent = request.sent_token_count > 0 or request.sent_text_len > 0
        logger.warning(
            "request %s: its grammar failed after %d tokens (%s)%s",
            request.request_id,
            len(request.output_token_ids),
            reason,
            f"; it starts again on {backends[0]}" if guided is not None and backends and not sent else "",
        )
        if guided is None or not backends or sent:
            self._fail(
                request,
                f"the grammar stopped before the output was complete ({reason}); no valid answer was produced",
                INTERNAL_ERROR,
                GRAMMAR_FAILED,
            )
            return
        self._forget(request)  # (its rows of this step are dropped: ``_emit_rows``)
        self._restarts.append(_Restart(request, guided, backends, [*refusals, reason]))

    def _start_again(self, restart: _Restart) -> None:
        """A request whose grammar failed, from its prompt on the next backend (``_grammar_failed``)."""
        old = restart.request
        request = Request(
            old.request_id,
            old.prompt_token_ids,
            old.params,
            old.arrival_time,
            IncrementalDetokenizer(self.tokenizer, old.prompt_token_ids),
            stream=old.stream,
        )
        request.stats.grammar_restarts = old.stats.grammar_restarts + 1
        try:
            request.compiling_since = time.monotonic()
            request.grammar_ready = self.grammar.submit(
                request.request_id, restart.guided, restart.backends, restart.refusals
            )
        except GrammarError as e:
            self.client_out.send(
                _error_output(
                    request, f"the grammar stopped before the output was complete: {e}", INTERNAL_ERROR, GRAMMAR_FAILED
                )
            )
            return
        if request.grammar_ready:
            request.grammar_backend, request.grammar_refusal = self.grammar.served(request.request_id)
        self.requests[request.request_id] = request
        self.batcher.add(request)

    def _fail_internal(self, request: Request, doing: str, e: Exception) -> None:
        """A bug met while serving one request: its traceback to the log, a one-line 500 to it."""
        logger.exception("request %s failed while %s", request.request_id, doing)
        self._fail(request, f"internal error while {doing}: {type(e).__name__}", INTERNAL_ERROR)

    def _forget_id(self, request_id: str) -> None:
        """``_forget`` for a request that may be half added."""
        request = self.requests.get(request_id)
        if request is not None:
            self._forget(request)
        else:
            self.grammar.release(request_id)

    def _plan_drafts(self, rows: list[ScheduledRow]) -> list[ScheduledRow]:
        """The drafter's plan for this step; a request whose drafter raised is failed and left out."""
        assert self.speculator is not None
        planned = self.speculator.plan(rows, self.cfg.max_num_batched_tokens)
        for request, error, details in self.speculator.take_failures():
            logger.error("request %s: its drafter failed:\n%s", request.request_id, details)
            self._fail(request, f"the drafter failed: {error}", INTERNAL_ERROR)
        return [row for row in planned if row.request.request_id in self.requests]

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
                self._fail_internal(self.requests[row.request_id], "filling its grammar's mask", e)
        return np.concatenate(parts)

    def _check_health(self) -> None:
        if self.stopping:  # the workers were told to stop: their exit is no failure
            return
        for rank, pid in self.worker_pids.items():
            if not _process_alive(pid):
                raise EngineFailure(f"worker rank {rank} (pid {pid}) died")
        if not parent_alive(self.parent_pid):
            self.stopping = True

    def fail_all(self, reason: str) -> None:
        logger.error("engine failed: %s", reason)
        for request in list(self.requests.values()):
            try:
                output = _error_output(request, reason, ENGINE_UNAVAILABLE)
            except Exception:
                output = RequestOutput(
                    request.request_id, [], "", True, "error", reason, error_status=ENGINE_UNAVAILABLE
                )
            self.client_out.send(output)
        self.requests.clear()
        self.client_out.send(EngineDead(reason))
        time.sleep(0.1)  # let the frames leave


def _error_output(request: Request, error: str, status: int, code: str = "") -> RequestOutput:
    """The request's last delta, ending it with ``error``."""
    output = finish_output(request, "error")
    return RequestOutput(
        output.request_id,
        output.new_token_ids,
        output.new_text,
        True,
        "error",
        error,
        output.num_prompt_tokens,
        error_status=status,
        error_code=code,
    )


@dataclass(frozen=True)
class _Restart:
    """A request whose grammar failed mid-way, to start again on the backends left to it."""

    request: Request
    guided: GuidedDecoding
    backends: list[str]
    refusals: list[str]


def _worker_failure(message: WorkerError) -> str:
    """A worker's failure for the clients: one line; its traceback goes to this log."""
    if message.details:
        logger.error("worker rank %d failed at step %d:\n%s", message.rank, message.step, message.details)
    return message.message.splitlines()[0] if message.message else f"worker rank {message.rank} failed"


def _split(flat: np.ndarray | None, counts: np.ndarray | None) -> list[list[int]] | None:
    """Per-row lists from a flat array and its per-row counts."""
    if flat is None or counts is None:
        return None
    ends = np.cumsum(counts).tolist()
    return [flat[end - n : end].tolist() for end, n in zip(ends, counts.tolist())]


def _process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
