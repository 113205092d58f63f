"""The scheduler process: its loop, start to end.

    wait for workers and the grammar compile process -> EngineReady ->
    loop: receive -> poll grammars -> schedule -> [plan drafts] -> send inputs
          -> [collect the step before, run ahead; advance its grammars] -> send bitmasks
          -> [the rest of its emit] -> [collect (answering draft-step mask requests) -> emit]

It owns every request's state (and, with guided decoding, every grammar). Workers see only
StepInputs on the shared-memory ring; rank 0 answers with StepOutputs over ZeroMQ. A worker
that reports an error or whose process disappears fails every request with a message naming
it, and the scheduler tells the client the engine is dead instead of hanging.

Failures that concern one request (its input, its grammar, its drafter) fail
that request alone, with a one-line message and a status saying whose fault it is; the
traceback goes to this process's log. A grammar that stops before its output is complete (a
backend's limit met mid-way) fails its request with ``GRAMMAR_FAILED``, or starts it again on
the next backend of "auto" while none of its output has reached the client.

Each stage has a module of its own, holding its state; this file wires them and runs the loop:

    intake.py        receive: validation, admission, grammar compiles, restarts after a grammar failed
    table.py         the request table: every request held, and how one ends (finished, aborted, failed)
    step_channel.py  broadcast and collect: inputs, bitmasks (held back while a grammar compiles),
                     draft steps' masks, the workers' outputs
    emit.py          the outputs into the requests (stop checks, jump-forward) and deltas to the client
    health.py        the workers' start and liveness, the client's
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import zmq

from guidespec import envs
from guidespec.config import MODEL_DRAFTERS, SchedulerConfig, SpeculativeConfig
from guidespec.cuda_ext.channel import DraftChannel
from guidespec.ipc import codec
from guidespec.ipc.broadcast import StepBroadcaster
from guidespec.ipc.shm_ring import RingTimeout
from guidespec.ipc.zmq_channel import Channel
from guidespec.model_files import shared_tokenizer
from guidespec.process_utils import freeze_startup_objects, setup_child_process
from guidespec.protocol import (
    INTERNAL_ERROR,
    AbortRequest,
    EngineReady,
    GenerateRequest,
    SchedulerStats,
    Shutdown,
    StepOutputs,
)
from guidespec.scheduler.batching import Batcher, ScheduledRow
from guidespec.scheduler.emit import Emitter
from guidespec.scheduler.grammar import CompileProcess, GrammarManager, grammar_settings
from guidespec.scheduler.health import EngineFailure, Health
from guidespec.scheduler.intake import Intake
from guidespec.scheduler.kv_blocks import BlockPool
from guidespec.scheduler.speculation.proposer import MAX_FORCED_DRAFTS, Speculator
from guidespec.scheduler.step_channel import COMPILE_POLL_S, IDLE_POLL_S, Step, StepChannel
from guidespec.scheduler.table import RequestTable
from guidespec.scheduler.trace import step_trace

logger = logging.getLogger(__name__)
_STATS_INTERVAL_S = 0.1  # SchedulerStats to the client at most this often


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


def _lookahead(cfg: SchedulerConfig) -> int:
    """Positions a row's blocks hold past its step's tokens: the most its drafts may take (the
    drafter's, the grammar's forced tokens, a draft model's proposals after the step)."""
    speculative = cfg.speculative
    if speculative is None:
        return MAX_FORCED_DRAFTS + 1 if cfg.jump_forward == "verified" else 0
    return MAX_FORCED_DRAFTS + 2 * speculative.max_draft_len + 1


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, parent_pid: int, compile_process: CompileProcess | None = None) -> None:
        self.cfg = cfg
        self.tokenizer = shared_tokenizer(cfg.model_dir)  # (the compile process's too, where forked)
        self.ctx = zmq.Context()
        self.client_in = Channel(self.ctx, zmq.PULL, cfg.client_in, bind=True)
        self.client_out = Channel(self.ctx, zmq.PUSH, cfg.client_out, bind=False)
        self.worker_results = Channel(self.ctx, zmq.PULL, cfg.worker_results, bind=True)
        self.broadcaster = StepBroadcaster(cfg.broadcast, self.ctx)
        # rank 0's model drafts come through the draft channel (cuda_ext) where it is local
        self.drafts = DraftChannel.attach(cfg.draft_channel) if cfg.draft_channel is not None else None
        # prefix caching needs every cache a step writes to follow the target's: not with a draft
        # model or an EAGLE head (their caches follow lazily)
        model_drafter = cfg.speculative is not None and cfg.speculative.method in MODEL_DRAFTERS
        # (a model drafter follows every position computed: a prompt's last token is not run twice)
        self.batcher = Batcher(
            cfg.max_batch_size,
            cfg.max_num_batched_tokens,
            cfg.enable_prefix_caching and not model_drafter,
            late_masks=not model_drafter,
            lookahead=_lookahead(cfg),
            max_model_len=cfg.max_model_len,
        )
        self.grammar = GrammarManager(grammar_settings(cfg), self.tokenizer, compile_process)
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
        self.trace = step_trace()  # (None unless GUIDESPEC_TRACE asks for one)
        self.health = Health(parent_pid)
        self.table = RequestTable(self.batcher, self.grammar, self.speculator, self.client_out)
        self.intake = Intake(cfg, self.batcher, self.grammar, self.table, self.client_out)
        self.steps = StepChannel(
            cfg,
            self.broadcaster,
            self.worker_results,
            self.drafts,
            self.grammar,
            self.speculator,
            self.table,
            self.intake,
            self.health,
        )
        self.emitter = Emitter(cfg, self.grammar, self.speculator, self.table)
        self._stats: SchedulerStats | None = None
        self._stats_sent_at = 0.0
        # in steps run one after another: the scheduler's planning and emitting (which running
        # ahead would hide behind the forward) over the rest of the step, a running mean
        self._host_share = 0.0

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        deadline = time.monotonic() + envs.worker_start_timeout_s()
        self.grammar.build_closing_tokens()  # (while the workers load: a pass over the vocabulary)
        self.health.wait_for_workers(self.worker_results, self.cfg.num_workers, deadline, IDLE_POLL_S)
        try:
            self.broadcaster.wait_for_readers(max(1.0, deadline - time.monotonic()))
        except RingTimeout as e:
            raise EngineFailure(str(e)) from None
        if not self.grammar.wait_started(max(1.0, deadline - time.monotonic())):
            logger.warning("the grammar compile process is not ready yet; guided requests will wait for it")
        num_blocks = min(self.health.kv_blocks.values())  # (every rank holds each block's share)
        self.batcher.use_pool(BlockPool(num_blocks, self.cfg.kv_block_size))
        logger.info("KV cache: %d blocks of %d positions", num_blocks, self.cfg.kv_block_size)
        logger.info("%d objects of the start kept out of garbage collection", freeze_startup_objects())
        cfg = self.cfg
        self.client_out.send(
            EngineReady(cfg.num_workers, cfg.max_batch_size, cfg.max_model_len, num_blocks, cfg.kv_block_size)
        )

    def run(self) -> None:
        """The loop. With ``async_scheduling`` (and no request that may get drafts in step N:
        ``_runs_ahead``), step N+1 is planned and sent while step N runs:
        its rows run the tokens N samples as the workers sampled them (``LAST_SAMPLED``); N's
        outputs advance their grammars meanwhile, N+1's bitmask is filled after that (its
        grammars then stand after N's tokens), still while N+1's forward runs, and the rest of
        N's emit comes after the bitmask."""
        in_flight: Step | None = None
        while not self.health.stopping:
            self.receive(busy=in_flight is not None)
            self.intake.poll_grammars()
            self.send_stats()
            if in_flight is not None and not self.steps.can_run_ahead:
                self._finish(in_flight)
                in_flight = None
            start = time.time()
            rows = self.batcher.schedule()
            if rows and self.speculator is not None:
                rows = self._plan_drafts(rows)
            run_ahead = self._runs_ahead(rows)
            step = self.steps.send_inputs(rows, start, run_ahead) if rows else None
            if step is not None and self.speculator is not None:
                step.drafted = self.speculator.drafted
            planned_ahead = in_flight is not None  # (``step``'s rows, without ``in_flight``'s outputs)
            collected = self._collect(in_flight) if in_flight is not None else None
            in_flight = None
            try:
                if step is not None:  # (its grammars stand after the collected tokens)
                    self.steps.send_bitmask(step)
            finally:
                if collected is not None:  # what the mask does not wait for: the rest of the emit, the deltas out
                    self._wrap_up(*self._emit(*collected))
            if step is not None:
                if planned_ahead and self.speculator is not None:  # (after the bitmask: not in its way)
                    self.speculator.observe_ahead(step.rows)
                if run_ahead:
                    in_flight = step
                else:
                    self._finish(step)
                    self._observe_host(step)

    def _runs_ahead(self, rows: list[ScheduledRow]) -> bool:
        """Whether the next step may be sent before this one's outputs: with async scheduling,
        where no row's request would lose drafts by it (they depend on every token before them):
        in an engine without a drafter, or whose only drafts are guided requests' forced tokens, a
        step without guided rows or while forced drafts are rare (``Speculator.may_run_ahead``).
        (A drafter's engine runs its steps one after another: a model drafter follows every
        position the target computes.)"""
        if not self.cfg.async_scheduling:
            return False
        if self.speculator is None:
            return True
        return self.speculator.may_run_ahead(rows, self._host_share)

    def _observe_host(self, step: Step) -> None:
        """A step run in turn: the host's part of it, outside the workers' (its planning and
        sending, its emit), over the rest (``_host_share``)."""
        t = step.times
        if "outputs" not in t:
            return
        host = (t["inputs"] - t["start"]) + (t["end"] - t["outputs"])
        rest = t["end"] - t["start"] - host
        if rest > 0:
            self._host_share = 0.8 * self._host_share + 0.2 * host / rest

    def _finish(self, step: Step) -> None:
        """Collect a step's outputs and emit them."""
        self._wrap_up(*self._emit(*self._collect(step)))

    def _collect(self, step: Step) -> tuple[Step, StepOutputs]:
        """Collect a step's outputs and advance its guided requests' grammars by them: what the next
        step's bitmask waits for (a step run ahead has it filled and sent before the rest)."""
        outputs = self.steps.collect(step)
        self.emitter.advance_grammars(step.rows, outputs, step.dropped)
        step.times["advanced"] = time.time()
        return step, outputs

    def _emit(self, step: Step, outputs: StepOutputs) -> tuple[Step, StepOutputs]:
        """Advance a step's requests by its outputs (their deltas wait in the outbox: ``_wrap_up``)."""
        step.times["emit_start"] = time.time()
        tokens = self.emitter.emit(step.rows, outputs, step.dropped)
        step.times["end"] = time.time()
        if self.speculator is not None:
            self.speculator.observe_emitted(step.drafted, step.rows, tokens, (step.times["start"], step.times["end"]))
        return step, outputs

    def _wrap_up(self, step: Step, outputs: StepOutputs) -> None:
        """A step's deltas out to the client, its blocks keyed for sharing, its trace."""
        self.table.send_outbox()
        self.batcher.commit(step.rows)
        if outputs.timings is not None and self.trace is not None:
            self.trace.record(
                step.step_id,
                step.times,
                outputs.timings,
                len(step.rows),
                len(step.guided),
                outputs.draft_s,
                sum(row.num_new_tokens for row in step.rows),
                step.draft_fills,
                outputs.fused,
                outputs.mask_waits,
                step.as_next,
            )

    def send_stats(self) -> None:
        """The queue's figures to the client when they change (at most every 0.1 s)."""
        now = time.monotonic()
        if now - self._stats_sent_at < _STATS_INTERVAL_S:
            return
        b = self.batcher
        compiling = sum(1 for r in b.waiting if not r.grammar_ready)  # (running ones count as running)
        stats = SchedulerStats(
            len(b.running),
            len(b.waiting) - compiling,
            compiling,
            len(b.free_slots),
            b.num_used_blocks,
            b.pool.num_blocks,
            b.pool.high_water,
            b.prefix_cache_queries,
            b.prefix_cache_hits,
            b.num_preemptions,
            self.grammar.compiler.num_compiled,
            self.grammar.compiler.num_shared,
        )
        if stats != self._stats:
            self.client_out.send(stats)
            self._stats, self._stats_sent_at = stats, now

    def fail_all(self, reason: str) -> None:
        self.table.fail_all(reason)

    def close(self) -> None:
        for channel in (self.client_in, self.client_out, self.worker_results):
            channel.close()
        self.grammar.shutdown()
        if self.trace is not None:  # (made where GUIDESPEC_TRACE names its file)
            self.trace.write(Path(str(envs.trace_path())))
        self.broadcaster.close()
        if self.drafts is not None:
            self.drafts.close()
        self.ctx.term()

    # ------------------------------------------------------------------ the step

    def receive(self, busy: bool = False) -> None:
        """Take in client messages: wait for one while idle, drain without waiting otherwise
        (``busy``: a step is in flight)."""
        if busy or self.batcher.has_runnable_work:
            timeout = 0.0
        else:
            timeout = COMPILE_POLL_S if self.grammar.has_pending else IDLE_POLL_S
        message = self.client_in.recv(timeout_s=timeout)
        while message is not None:
            self._handle_client_message(message)
            message = self.client_in.recv_nowait()
        if not self.batcher.has_work:
            self.health.check()

    def _handle_client_message(self, message: Any) -> None:
        if isinstance(message, GenerateRequest):
            self.intake.add(message)
        elif isinstance(message, AbortRequest):
            self.intake.abort(message.request_id)
        elif isinstance(message, Shutdown):
            self.health.stopping = True
            try:
                self.broadcaster.write(codec.encode(Shutdown(message.reason)), timeout=2.0)
            except RingTimeout:
                logger.warning("a worker did not take the shutdown message; the launcher will stop it")
        else:
            logger.warning("ignoring unexpected %s from the client", type(message).__name__)

    def _plan_drafts(self, rows: list[ScheduledRow]) -> list[ScheduledRow]:
        """The drafter's plan for this step; a request whose drafter raised is failed and left out."""
        assert self.speculator is not None
        planned = self.speculator.plan(rows, self.cfg.max_num_batched_tokens)
        failures = self.speculator.take_failures()
        if not failures:  # (the rows' requests are all running: the table holds them)
            return planned
        for request, error, details in failures:
            logger.error("request %s: its drafter failed:\n%s", request.request_id, details)
            self.table.fail(request, f"the drafter failed: {error}", INTERNAL_ERROR)
        return [row for row in planned if row.request.request_id in self.table.requests]
