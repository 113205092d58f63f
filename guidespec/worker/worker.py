"""The worker process: its loop, start to end.

    attach ring -> load model shard -> report ready ->
    loop: read StepInputs -> forward [+ draft model or EAGLE head follows] -> [read StepBitmask]
          -> LM head (rows whose mask allows one token skip it; one rank computes it while the
          bitmask is still due) [-> apply the bitmask, or read it while picking greedily]
          -> sample or verify drafts (rank 0) -> [draft model proposes next drafts (rank 0)] -> send StepOutputs
    (a model drafter with graph_grammar: a verify step of greedy or sampled rows runs whole
    as one graph instead on rank 0, its verify masks through the draft channel, the target's part of
    it on the others: worker/drafting/step_graph.py)

Every rank runs the same forward (collectives inside); only rank 0 computes the sampled
tokens and answers the scheduler. Any exception is reported as a WorkerError naming the rank
and the cause before the process exits, so the scheduler can fail in-flight requests.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from guidespec import envs
from guidespec.config import ModelConfig, WorkerConfig
from guidespec.cuda_ext.channel import VERIFY, DraftChannel, DraftChannelError, StreamExchange
from guidespec.ipc import codec
from guidespec.ipc.broadcast import create_step_reader
from guidespec.ipc.shm_ring import RingTimeout
from guidespec.ipc.zmq_channel import Channel
from guidespec.process_utils import freeze_startup_objects, parent_alive, setup_child_process
from guidespec.protocol import (
    LAST_SAMPLED,
    NO_TOKEN,
    DraftMask,
    DraftTokens,
    MaskWanted,
    Shutdown,
    StepBitmask,
    StepInputs,
    StepNext,
    StepOutputs,
    WorkerError,
    WorkerReady,
    all_last_sampled,
    follows_as_next,
    next_inputs,
)
from guidespec.worker.drafting.draft_model import DraftRunner, draft_model_bytes
from guidespec.worker.drafting.eagle import EagleRunner
from guidespec.worker.drafting.eagle_head import head_bytes
from guidespec.worker.drafting.step_graph import FusedStepFollower, StepGraphs
from guidespec.worker.verify import _argmax_and_dead, accept_greedy, greedy_tokens, verify
from guidespec.worker import tp as tp_mod
from guidespec.model_files import load_hf_config
from guidespec.worker.device import check_device_memory, kv_pool_blocks
from guidespec.worker.graphs import GraphRunner
from guidespec.worker import kernels
from guidespec.bitmask import allowed_counts, allowed_ids, bitmask_width
from guidespec.worker.mask import DeviceMasks, only_allowed
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.model import LlamaModel
from guidespec.worker.penalties import TokenHistory
from guidespec.worker.core_share import CoreShare

_IDLE_READ_TIMEOUT_S = 1.0
_ROWS_PER_REQUEST = 9  # logits rows a request has in a step (1 + drafts), without a mask arena to say
_CPU_GRACE_S = 0.02  # an overlapped step on the CPU waits this long for the next one (_Done)
# rank 0 waits this long for a step's bitmask before it asks for it (``MaskWanted``: a scheduler
# holding it while a grammar compiles then writes it at once); a bitmask on its way is not asked
# for (a message each way, which at 64 regex rows came most steps)
_MASK_WANTED_AFTER_S = 0.002
_FEW_TOKENS = 4  # a mask allowing at most vocab / 4 tokens: their logits alone cost less than all
logger = logging.getLogger(__name__)


def run_worker(cfg: WorkerConfig, parent_pid: int) -> None:
    """Process entry point."""
    setup_child_process(f"worker{cfg.rank}")
    if cfg.device == "cpu" and kernels.available():  # the kernels' pool has the threads (loader.set_threads)
        kernels.set_threads(cfg.num_threads)
        torch.set_num_threads(1)
    else:
        torch.set_num_threads(cfg.num_threads)
    ctx = zmq.Context()
    results = Channel(ctx, zmq.PUSH, cfg.worker_results, bind=False)
    worker = None
    try:
        worker = Worker(cfg, ctx)
        freeze_startup_objects()  # (the model's loading: no full collection walks it again)
        results.send(WorkerReady(cfg.rank, os.getpid(), worker.kv.scratch_block))
        worker.loop(results, parent_pid)
    except Exception as e:
        first_line = (str(e).splitlines() or [""])[0][:200]
        results.send(
            WorkerError(
                cfg.rank,
                f"worker rank {cfg.rank} failed: {type(e).__name__}: {first_line}",
                details=traceback.format_exc(),
            )
        )
        time.sleep(0.2)  # let the frame leave before the socket is torn down
        raise SystemExit(1)
    finally:
        if worker is not None:
            worker.close_drafts()
            worker.masks.close()  # unregister the arena's pages before the reader unmaps them
            worker.reader.close()
        results.close()
        ctx.term()
        tp_mod.destroy_distributed()


def collective_backend(device_type: str, requested: str | None, captured: bool = False) -> str:
    """The torch.distributed backend of a rank on ``device_type``: ``requested``
    (``envs.tp_backend``) where set, else NCCL on CUDA and gloo on the CPU. ValueError for NCCL off
    CUDA, and for gloo where CUDA graphs would hold the collectives (``captured``): gloo's wait on
    the host, which a graph cannot hold."""
    backend = requested or ("nccl" if device_type == "cuda" else "gloo")
    if backend == "nccl" and device_type != "cuda":
        raise ValueError(f"NCCL (GUIDESPEC_TP_BACKEND=nccl) needs CUDA ranks, not {device_type}")
    if backend == "gloo" and device_type == "cuda" and captured:
        raise ValueError(
            "tensor-parallel CUDA ranks over gloo (GUIDESPEC_TP_BACKEND=gloo) run eagerly: a CUDA graph "
            "cannot hold gloo's collectives; pass enforce_eager=True"
        )
    return backend


class Worker:
    def __init__(self, cfg: WorkerConfig, ctx: zmq.Context) -> None:
        self.cfg = cfg
        self.tp = tp_mod.TPInfo(cfg.rank, cfg.tensor_parallel_size)
        self.device = torch.device(cfg.device)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)  # before NCCL: its communicator binds the current device
        captured = cuda and not cfg.enforce_eager and self.tp.size > 1  # (collectives inside CUDA graphs)
        backend = collective_backend(self.device.type, envs.tp_backend(), captured)
        tp_mod.init_distributed(self.tp, cfg.dist_init_method, backend, cfg.collectives)
        hf_config = load_hf_config(cfg.model_dir, cfg.hf_config)
        model_cfg = ModelConfig.from_hf(hf_config)
        dtype = getattr(torch, cfg.dtype)
        arena = cfg.broadcast.arena
        max_rows = arena.num_rows if arena is not None else cfg.max_batch_size * _ROWS_PER_REQUEST
        # CUDA graphs pad batches onto a scratch slot: one KV slot more than the batch (an EAGLE
        # head's features come out of the graphs too; a draft model sharing the cache pads onto it)
        use_graphs = cuda and not cfg.enforce_eager
        num_slots = cfg.max_batch_size + (1 if use_graphs or cfg.fused_steps or cfg.draft_graphs else 0)
        drafter_bytes = 0
        if cfg.draft_model is not None and self.tp.is_driver:  # (counted on CUDA only; computed everywhere)
            # (as the drafter allocates them: the head's cache and a draft model's own have a scratch slot)
            size = (self.tp.size, cfg.max_batch_size + 1, cfg.max_model_len)
            if cfg.draft_method == "eagle":
                drafter_bytes = head_bytes(Path(cfg.draft_model), model_cfg, dtype, *size)
            else:
                drafter_bytes = draft_model_bytes(cfg.draft_model, cfg.model_dir, model_cfg, dtype, *size)
        plan = check_device_memory(  # (the least a pool holds: one sequence of max_model_len)
            model_cfg,
            dtype,
            self.tp.size,
            1,
            cfg.max_model_len,
            max_rows,
            cfg.device,
            cfg.gpu_memory_utilization,
            drafter_bytes,
        )
        self.model = LlamaModel(
            model_cfg, self.tp, dtype, cfg.max_model_len, cfg.device, quantized=cfg.quantized_weights
        )
        self.model.load(cfg.model_dir, hf_config, show_progress=self.tp.is_driver and cfg.show_progress)
        num_blocks = kv_pool_blocks(
            dataclasses.replace(plan, kv_cache=0),
            plan.kv_cache // cfg.max_model_len,
            cfg.kv_block_size,
            cfg.max_model_len,
            num_slots,
            cfg.device,
            cfg.gpu_memory_utilization,
            cfg.kv_cache_tokens,
            self.tp.size,
        )
        self.kv = self.model.create_kv_cache(num_slots, cfg.kv_block_size, num_blocks)
        # (as the cache: its last slot the scratch slot a fused step's padding writes)
        self.history = TokenHistory(num_slots, model_cfg.vocab_size, self.device)
        self.last_sampled = np.zeros(num_slots, np.int32)  # rank 0: each slot's last sampled token
        self.reader = create_step_reader(cfg.broadcast, cfg.ring_index, ctx)
        self.masks = DeviceMasks(
            self.device, max_rows, bitmask_width(model_cfg.vocab_size), self.reader.arena_buffers()
        )
        self.generator = torch.Generator(device=self.device).manual_seed(int.from_bytes(os.urandom(7), "little"))
        # rank 0's draft steps: through the draft channel's C functions (cuda_ext), called directly
        # or by the C host stream; without a channel (a remote rank 0), as messages
        self.drafts = DraftChannel.attach(cfg.draft_channel) if cfg.draft_channel is not None else None
        self.stream_exchange = None
        if self.drafts is not None and envs.draft_channel() == "stream":
            self.stream_exchange = StreamExchange(self.drafts, envs.draft_mask_timeout_s(), cfg.scheduler_pid)
        self.drafter: DraftRunner | EagleRunner | None = None
        if cfg.draft_model is not None and self.tp.is_driver:
            if cfg.draft_method == "eagle":
                self.drafter = EagleRunner(
                    Path(cfg.draft_model), self.model, cfg.model_dir, hf_config, cfg.max_batch_size, cfg.max_model_len
                )
            else:
                self.drafter = DraftRunner(
                    cfg.draft_model,
                    cfg.model_dir,
                    dtype,
                    cfg.max_batch_size,
                    cfg.max_model_len,
                    model_cfg.vocab_size,
                    (self.model, self.kv),
                    cfg.device,
                )
            if cfg.draft_graphs and self.drafts is not None:  # draft steps as graphs, grammar waits inside
                self.drafter.use_graphs(self.drafts, envs.draft_mask_timeout_s(), cfg.scheduler_pid, capture=cuda)
        # whole steps of a model drafter as one graph each (worker/drafting/step_graph.py): rank 0 runs the step, the
        # other ranks its target part (every rank decides from the step's inputs alone)
        self.step_graphs: StepGraphs | None = None
        self.step_follower: FusedStepFollower | None = None
        if cfg.fused_steps and self.tp.is_driver:
            if self.drafter is None or self.drafter.graphs is None:
                raise ValueError("fused steps need a model drafter with draft graphs on rank 0")
            self.drafter.sampling.greedy = True  # (sampled rows too: a fused step verifies them with one-hot q')
            self.step_graphs = StepGraphs(
                self.drafter, self.model, self.kv, max_rows, envs.step_timeout_s(), self.history
            )
        elif cfg.fused_steps:
            self.step_follower = FusedStepFollower(self.model, self.kv, cfg.max_batch_size, max_rows, use_graphs)
        # overlapped decode steps (``_overlapped_step``): a step's picks, two steps' worth of page-locked rows
        self.overlap = envs.overlap_steps(self.device.type)
        self.pending: _Pending | None = None
        self._before: StepInputs | None = None  # the last step's inputs, where a StepNext may follow them
        self._follows = (-1, -1)  # (the last StepNext's step, the step it follows)
        self._made: tuple[int, ForwardBatch] | None = None  # the last batch ``step`` made, and its step
        self._picked = [torch.zeros(max_rows, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self._flip = 0
        # a CPU rank 0 whose kernels take every core: one left to the scheduler while masked steps
        # wait for their masks (core_share.py)
        self.core_share = None
        if self.device.type == "cpu" and self.tp.size == 1 and self.drafter is None and envs.core_share():
            self.core_share = CoreShare.create(cfg.num_threads)
        self.graphs = None
        if use_graphs:
            features = self.drafter.capture if self.drafter is not None else None
            self.graphs = GraphRunner(self.model, self.kv, cfg.max_batch_size, capture=True, features=features)

    def close_drafts(self) -> None:
        if self.stream_exchange is not None:
            self.stream_exchange.close()
        if self.drafts is not None:
            self.drafts.close()

    def loop(self, results: Channel, parent_pid: int) -> None:
        self.results = results
        folder = envs.torch_profiler_dir()
        self.profiler = _StepProfiler(Path(folder)) if folder is not None and self.tp.rank == 0 else None
        while True:
            if self.pending is not None and not self._next_ready(self.pending):
                results.send(self._finish_pending())  # nothing to launch behind it: its tokens go now
            message = self._next_message(parent_pid)
            overlapped = isinstance(message, StepInputs) and self._overlaps(message)
            if self.pending is not None and not overlapped:
                results.send(self._finish_pending())
            if isinstance(message, Shutdown):
                return
            if isinstance(message, DraftMask):  # rank 0's draft loop reads these; the other ranks skip them
                continue
            if not isinstance(message, StepInputs):
                raise RuntimeError(f"expected StepInputs on the ring, got {type(message).__name__}")
            if self.profiler is not None:
                self.profiler.tick()
            if overlapped:
                self._overlapped_step(message)  # (its outputs leave later)
                continue
            outputs = self.step(message)
            if outputs is not None:
                results.send(outputs)

    def step(self, inputs: StepInputs) -> StepOutputs | None:
        if all_last_sampled(inputs.token_ids) or (inputs.token_ids == LAST_SAMPLED).any():
            inputs = self._with_last_sampled(inputs)
        if inputs.table_slots is not None:
            self.kv.set_tables(inputs.table_slots, inputs.table_lens, inputs.table_blocks)  # type: ignore[arg-type]
        if self.step_graphs is not None and self.step_graphs.fits(inputs):
            return self._fused_step(inputs)
        if self.step_follower is not None and self.step_follower.fits(inputs):
            self.step_follower.run(inputs)
            if inputs.has_bitmask:  # (rank 0 applies it; read to keep the ring in order)
                self._read_bitmask(inputs.step)
            return None
        start, wall_start = time.perf_counter(), time.time()
        made = self._made
        if made is not None and self._follows == (inputs.step, made[0]):  # a StepNext's: the batch before's, on
            batch = made[1].advanced(inputs.token_ids)
        else:
            batch = ForwardBatch.create(
                inputs.token_ids, inputs.slots, inputs.start_positions, inputs.num_new_tokens, inputs.num_logits
            )
        self._made = (inputs.step, batch)
        key = self.graphs.plan(batch) if self.graphs is not None else None
        share = self.core_share if inputs.has_bitmask else None
        if share is not None:
            share.begin()
        if key is not None:  # decode and verify steps: a replayed CUDA graph (graphs.py)
            hidden = self.graphs.run(batch, key)  # type: ignore[union-attr]
        else:
            hidden = self.model.forward(batch, self.kv, self.drafter.capture if self.drafter is not None else None)
        if share is not None:
            share.end()
        if self.drafter is not None:
            self.drafter.follow(batch, self.model.captured)
        forward_end = mask_ready = time.time()
        penalized = inputs.penalized  # [B]: requests that ask for one
        # greedy rows on the CPU: a row's mask is read by its pick (verify.py), not applied
        greedy = (
            self.device.type == "cpu"
            and inputs.has_bitmask
            and self.drafter is None
            and not penalized.any()
            and not inputs.temperature.any()
        )
        # the bitmask before the LM head (filled while the layers ran): rows whose mask allows one
        # token get it without logits, on every rank alike (the LM head's gather is collective).
        # One rank whose bitmask is not there yet computes the LM head meanwhile instead, unless
        # its greedy picks skip what the masks forbid (a JSON row between values needs ~2% of it)
        bitmask = early = None
        if inputs.has_bitmask:
            if self.tp.size == 1 and not (greedy and self.model.picks_skip_masked) and not self.reader.poll():
                early = self.model.compute_logits(hidden)
            waiting = time.perf_counter()
            bitmask = self._read_bitmask(inputs.step)
            mask_ready = time.time()
            waited = time.perf_counter() - waiting
            if share is not None:
                share.observe(waiting - start, waited)
            # forward_s is the step's work (the plan's cost model: ``CostModel``), not its wait:
            # a new request's first mask can wait for its grammar (a prefill of 19 tokens of the
            # tiny model read 35 ms, and its fit then priced a draft token at a whole step)
            start += waited
        defer = greedy and (inputs.num_logits == 1).all()
        if greedy and early is None:  # (no logits rows for what the mask settles: greedy_masked)
            picked = greedy_masked(self, hidden, bitmask)  # type: ignore[arg-type]
            if picked is None:
                return None
            if not defer:  # rows with drafts: accepted by the picks
                picked = accept_greedy(picked[0], inputs.num_logits, _drafts(inputs))
            return self._outputs(inputs, *picked, (start, wall_start, forward_end, mask_ready))
        if bitmask is None and not penalized.any() and not inputs.temperature.any() and (inputs.num_logits == 1).all():
            picked = self.model.compute_picks(hidden)  # greedy decode rows: their picks, without logits
            if picked is not None:
                return self._outputs(inputs, *greedy_tokens(*picked), (start, wall_start, forward_end, mask_ready))
        logits, unapplied = _logits_and_masks(self, hidden, bitmask, early)
        if logits is not None and unapplied is not None and not defer:
            self.masks.apply(logits, *unapplied)
            unapplied = None
        if logits is None:
            return None
        if penalized.any():
            self.history.update(
                batch.slots,
                batch.start_positions,
                batch.num_new_tokens,
                batch.token_ids,
                inputs.num_prompt_tokens.tolist(),
                penalized.tolist(),
            )
            rows = np.repeat(np.arange(inputs.batch_size), inputs.num_logits)
            penalties = torch.from_numpy(inputs.penalties[rows].copy())  # per-row scalars: read on the host
            self.history.apply(logits, torch.from_numpy(inputs.slots[rows].copy()), *penalties.unbind(1))
        # rows without drafts are sampled; rows with drafts are verified (worker/verify.py)
        drafts = _drafts(inputs)
        draft_probs = self.drafter.sampling.draft_probs(inputs, drafts) if self.drafter is not None else None
        tokens_np, counts = verify(
            logits,
            inputs.num_logits,
            drafts,
            inputs.temperature,
            inputs.top_k,
            inputs.top_p,
            inputs.seeds,
            inputs.sample_index,
            self.generator,
            draft_probs,
            unapplied,
        )
        return self._outputs(inputs, tokens_np, counts, (start, wall_start, forward_end, mask_ready))

    def _outputs(
        self,
        inputs: StepInputs,
        tokens_np: np.ndarray,
        counts: np.ndarray,
        times: tuple[float, float, float, float],
    ) -> StepOutputs:
        """Rank 0's answer to a step whose tokens are picked: the next drafts proposed, and its
        ``times`` (perf_counter start; wall start, forward end, mask ready)."""
        start, wall_start, forward_end, mask_ready = times
        ends = np.cumsum(counts)
        sampled = counts > 0
        self.last_sampled[inputs.slots[sampled]] = tokens_np[ends[sampled] - 1]
        proposals = draft_counts = None
        verified = time.perf_counter()
        waits: list[tuple[float, float, float]] = []
        if self.drafter is not None and inputs.draft_lens is not None:
            masks = _DraftMasks(self, inputs.step, waits)
            try:
                proposals, draft_counts = self.drafter.propose(inputs, tokens_np, counts, masks)
            except DraftChannelError as e:  # no mask came: nothing of this step's drafting is used
                logger.warning("worker rank 0: %s; no drafts this step", e)
                proposals = draft_counts = None
            finally:
                if self.drafts is not None:
                    self.drafts.done(inputs.step)
                if self.drafter.graphs is not None:  # (draft steps as a graph: their trampolines timed the waits)
                    waits += self.drafter.graphs.take_waits()
        draft_s = time.perf_counter() - verified
        if self.device.type == "cpu":  # (the step's last parallel region is done: the scheduler gets the core)
            kernels.park_threads()
        timings = np.array([wall_start, forward_end, mask_ready, time.time()], dtype=np.float64)
        return StepOutputs(
            inputs.step,
            tokens_np,
            counts,
            verified - start,
            timings,
            proposals,
            draft_counts,
            draft_s,
            mask_waits=np.array(waits, dtype=np.float64).reshape(-1, 3) if waits else None,
        )

    def _overlaps(self, inputs: StepInputs) -> bool:
        """Whether ``inputs`` runs as an overlapped step (:meth:`_overlapped_step`): on one rank
        without a drafter, a decode step of greedy rows without masks or penalties."""
        return (
            self.overlap
            and self.tp.size == 1
            and self.drafter is None
            and self.step_graphs is None
            and not inputs.has_bitmask
            and inputs.draft_lens is None
            and (inputs.num_new_tokens == 1).all()
            and (inputs.num_logits == 1).all()
            and not inputs.temperature.any()
            and not inputs.penalized.any()
        )

    def _overlapped_step(self, inputs: StepInputs) -> None:
        """Launch a decode step without waiting for the one before (CUDA: the GPU runs them in
        order). Rows whose token is the step before's newest (``LAST_SAMPLED``, async scheduling)
        read it on the device, where that step's greedy picks still are; the step's picks are
        copied to page-locked memory behind its kernels, and the step before's outputs go to the
        scheduler while this one runs. This step's own outputs leave once the next step is
        launched, or when it is done and nothing else came (``loop``)."""
        start, wall_start = time.perf_counter(), time.time()
        before, self.pending = self.pending, None
        if inputs.table_slots is not None:
            self.kv.set_tables(inputs.table_slots, inputs.table_lens, inputs.table_blocks)  # type: ignore[arg-type]
        token_ids = inputs.token_ids.copy()
        where = np.flatnonzero(token_ids == LAST_SAMPLED)
        slots = inputs.slots[where]  # (one token a row)
        from_device = None
        if len(where):
            running = np.isin(slots, before.inputs.slots) if before is not None else np.zeros(len(where), bool)
            token_ids[where[~running]] = self.last_sampled[slots[~running]]
            if running.any():
                assert before is not None
                order = np.argsort(before.inputs.slots)  # (each running slot's row in the step before)
                rows = order[np.searchsorted(before.inputs.slots[order], slots[running])]
                token_ids[where[running]] = 0  # (written on the device before the forward)
                from_device = (where[running], before.picks[_index_on(self.device, rows)])
        batch = ForwardBatch.create(
            token_ids, inputs.slots, inputs.start_positions, inputs.num_new_tokens, inputs.num_logits
        )
        key = self.graphs.plan(batch) if self.graphs is not None else None
        if key is not None:
            hidden = self.graphs.run(batch, key, from_device)  # type: ignore[union-attr]
        else:
            hidden = self.model.forward(self._device_tokens(batch, from_device), self.kv)
        logits = self.model.compute_logits(hidden)
        assert logits is not None
        picks = logits.argmax(dim=-1)
        self._flip ^= 1  # (the step before's buffer may still be read)
        host = self._picked[self._flip][: len(picks)]
        host.copy_(picks, non_blocking=True)
        done = torch.cuda.Event() if self.device.type == "cuda" else _Done()
        done.record()
        self.pending = _Pending(inputs, picks, host, done, (start, wall_start, time.time()))
        if before is not None:
            self.results.send(self._outputs_of(before))

    def _device_tokens(self, batch: ForwardBatch, from_device: tuple[np.ndarray, torch.Tensor] | None) -> ForwardBatch:
        """``batch`` on the device with the tokens ``from_device`` (token indexes, device values) put in."""
        batch = batch.to(self.device)
        if from_device is not None:
            index, values = from_device
            batch.token_ids[_index_on(self.device, index)] = values
        return batch

    def _next_ready(self, pending: _Pending) -> bool:
        """Wait until the next message is there (True) or ``pending``'s picks are (False)."""
        while not self.reader.poll():
            if pending.done.query():
                return self.reader.poll()
        return True

    def _finish_pending(self) -> StepOutputs:
        pending, self.pending = self.pending, None
        assert pending is not None
        return self._outputs_of(pending)

    def _outputs_of(self, pending: _Pending) -> StepOutputs:
        """An overlapped step's outputs, once its picks are on the host."""
        pending.done.synchronize()
        tokens = pending.host.numpy().astype(np.int32)
        start, wall_start, launched = pending.times
        counts = np.ones(len(tokens), dtype=np.int32)
        return self._outputs(pending.inputs, tokens, counts, (start, wall_start, launched, launched))

    def _with_last_sampled(self, inputs: StepInputs) -> StepInputs:
        """``inputs`` with each ``LAST_SAMPLED`` token replaced by the one rank 0 sampled for its
        row's slot in the step before (a step sent before that one's outputs came back: async
        scheduling); rank 0 gives the other ranks its tokens."""
        if all_last_sampled(inputs.token_ids):  # (a StepNext's: a token a row, each row's)
            token_ids = self._broadcast_tokens(self.last_sampled[inputs.slots])
        else:
            token_ids = inputs.token_ids.copy()
            where = np.flatnonzero(token_ids == LAST_SAMPLED)
            slots = np.repeat(inputs.slots, inputs.num_new_tokens)[where]
            token_ids[where] = self._broadcast_tokens(self.last_sampled[slots])
        replaced = object.__new__(StepInputs)  # (dataclasses.replace's checks, 8 µs, find nothing to check here)
        replaced.__dict__.update(inputs.__dict__, token_ids=token_ids)
        return replaced

    def _broadcast_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """Rank 0's ``tokens`` (int32) on every rank (one rank: ``tokens`` themselves)."""
        if self.tp.size == 1:
            return tokens
        return tp_mod.broadcast_ints(tokens.astype(np.int64), self.tp, self.device).astype(np.int32)

    def _fused_step(self, inputs: StepInputs) -> StepOutputs:
        """A step of a model drafter as one graph (worker/drafting/step_graph.py): its verify masks come through
        the draft channel; the ring's copy of them is read after, to keep the ring in order."""
        assert self.step_graphs is not None
        start, wall_start = time.perf_counter(), time.time()
        try:
            fused = self.step_graphs.run(inputs)
        finally:
            if self.drafts is not None:
                self.drafts.done(inputs.step)
        if inputs.has_bitmask:
            self._read_bitmask(inputs.step)
        end = time.time()
        # (the draft steps ran last: forward_s is the rest, less its wait for the verify masks,
        # timed as an unfused step's verify is)
        draft_s = fused.draft_s
        waits = fused.mask_waits
        verify_wait = float((waits[:, 2] - waits[:, 1])[waits[:, 0] == VERIFY].sum()) if len(waits) else 0.0
        timings = np.array([wall_start, end - draft_s, end - draft_s, end], dtype=np.float64)
        proposals, draft_counts = fused.proposals if fused.proposals is not None else (None, None)
        return StepOutputs(
            inputs.step,
            fused.tokens,
            fused.counts,
            time.perf_counter() - start - draft_s - verify_wait,
            timings,
            proposals,
            draft_counts,
            draft_s,
            fused=True,
            mask_waits=fused.mask_waits if len(fused.mask_waits) else None,
        )

    def _logits(self, hidden: torch.Tensor, mask: tuple[np.ndarray, np.ndarray] | None) -> torch.Tensor | None:
        """Masked fp32 logits [R, vocab] on rank 0 (None elsewhere). A row whose mask allows one
        token skips the LM head: -inf everywhere but that token. A row whose mask allows few
        tokens (a JSON grammar between values: punctuation, a key, a digit) gets only theirs where
        the model can compute them alone (one rank, GGUF blocks), each what the whole LM head
        gives, so no pick changes."""
        logits, rest = _logits_and_masks(self, hidden, mask)
        if logits is not None and rest is not None:
            self.masks.apply(logits, *rest)
        return logits

    def _read_bitmask(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The step's bitmask: (logits rows, bitmask rows), read in place from the mask arena
        where they are there."""
        payload = None
        if not self.reader.poll():
            kernels.park_threads()  # (the scheduler fills it: the kernels' helpers leave it the core)
            if self.tp.is_driver:  # the scheduler may hold it for a compile: asked for if it is late
                try:
                    payload = self.reader.read(timeout=_MASK_WANTED_AFTER_S)
                except RingTimeout:
                    self.results.send(MaskWanted(step))
        message = codec.decode(payload if payload is not None else self.reader.read(timeout=60.0))
        if not isinstance(message, StepBitmask) or message.step != step:
            raise RuntimeError(f"step {step}: expected its bitmask, got {type(message).__name__}")
        return message.rows, self.reader.bitmask(message)

    def _next_message(self, parent_pid: int) -> object:
        if not self.reader.poll():
            kernels.park_threads()  # (the kernels' helpers sleep while the scheduler plans the next step)
        while True:
            try:
                message = codec.decode(self.reader.read(timeout=_IDLE_READ_TIMEOUT_S))
                break
            except RingTimeout:
                if not parent_alive(parent_pid):
                    return Shutdown("parent process is gone")
        if isinstance(message, StepNext):  # the step before's rows, each one position on
            if self._before is None:
                raise RuntimeError(f"step {message.step}: a StepNext after a step it cannot follow")
            self._follows = (message.step, self._before.step) if message.keep is None else (-1, -1)
            message = next_inputs(self._before, message)
            self._before = message
        elif isinstance(message, StepInputs):
            self._before = message if follows_as_next(message) else None
        return message


@dataclasses.dataclass
class _Pending:
    """An overlapped step launched, its outputs not yet sent."""

    inputs: StepInputs
    picks: torch.Tensor  # [B] on the device
    host: torch.Tensor  # [B] page-locked, filled behind the step's kernels
    done: Any  # torch.cuda.Event after that copy
    times: tuple[float, float, float]  # perf_counter start, wall start, wall time launched


class _Done:
    """A CPU step's stand-in for a CUDA event. Its work ended when the call did; it reads as
    running for ``_CPU_GRACE_S`` more, so the next step can be launched behind it as on a GPU
    (``GUIDESPEC_OVERLAP_STEPS=1`` on the CPU: how the tests without a GPU run that path)."""

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return time.perf_counter() - self.at > _CPU_GRACE_S

    def synchronize(self) -> None:
        pass


class _DraftMasks:
    """Rank 0's draft steps' masks (a MaskSource): ``post`` sends a draft step's tokens up to the
    scheduler, ``take`` waits for its mask rows. Through the draft channel's C functions (called
    directly, or run by the C host stream: DraftChannelError where none came in time, or the
    scheduler died), else as a message whose mask comes back over the ring."""

    def __init__(self, worker: Worker, step: int, waits: list[tuple[float, float, float]]) -> None:
        self.worker, self.step = worker, step
        self.rows = 0  # rows posted to the draft channel, whose masks ``take`` waits for
        self.waits = waits  # (draft index, start, end) of each ``take``, wall times

    def post(self, draft_index: int, rows: np.ndarray, sequences: list[list[int]]) -> None:
        w = self.worker
        if w.stream_exchange is not None:
            w.stream_exchange.post(self.step, draft_index, rows, sequences)
        elif w.drafts is not None:
            w.drafts.publish(self.step, draft_index, rows, sequences)
            self.rows = len(rows)
        else:
            flat = np.array([t for seq in sequences for t in seq], dtype=np.int32)
            lens = np.array([len(s) for s in sequences], np.int32)
            w.results.send(DraftTokens(self.step, draft_index, rows, flat, lens))

    def take(self, draft_index: int) -> np.ndarray:
        started = time.time()
        try:
            return self._take(draft_index)
        finally:
            self.waits.append((float(draft_index), started, time.time()))

    def _take(self, draft_index: int) -> np.ndarray:
        w, step = self.worker, self.step
        if w.stream_exchange is not None:
            return w.stream_exchange.take(step, draft_index)
        if w.drafts is not None:
            return w.drafts.wait(step, draft_index, self.rows, envs.draft_mask_timeout_s(), w.cfg.scheduler_pid)
        message = codec.decode(w.reader.read(timeout=60.0))
        if not isinstance(message, DraftMask) or (message.step, message.draft_index) != (step, draft_index):
            raise RuntimeError(f"step {step}: expected the mask of draft {draft_index}, got {type(message).__name__}")
        return message.bitmask


def _logits_and_masks(
    worker: Worker,
    hidden: torch.Tensor,
    mask: tuple[np.ndarray, np.ndarray] | None,
    computed: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, tuple[np.ndarray, np.ndarray] | None]:
    """``Worker._logits`` with the masks of the rows that need the whole LM head left to apply:
    (logits, (rows, bitmask) or None). ``computed``: the LM head's logits of every row,
    computed while the mask was awaited (the masks are then all left)."""
    if mask is None:
        return worker.model.compute_logits(hidden), None
    if computed is not None:
        return computed, mask
    rows, bitmask = mask
    vocab = worker.model.cfg.vocab_size
    forced, few = _settled_rows(worker, rows, bitmask, hidden.shape[0])
    if not (forced >= 0).any() and not few.any():
        return worker.model.compute_logits(hidden), (rows, bitmask)
    whole = forced < 0  # logits rows that need the whole LM head
    whole[rows[few]] = False
    keep = _index_on(worker.device, np.flatnonzero(whole))
    computed = worker.model.compute_logits(hidden[keep]) if len(keep) else None
    if not worker.tp.is_driver:
        return None, None
    logits = torch.empty((hidden.shape[0], vocab), dtype=torch.float32, device=worker.device)
    if computed is not None:
        logits[keep] = computed
    logits.index_fill_(0, _index_on(worker.device, np.flatnonzero(~whole)), float("-inf"))  # (only the others)
    single = np.flatnonzero(forced >= 0)
    # (index_fill_ takes the 0 as an argument; assigning a Python number copies it to the
    # device from pageable memory, a copy that waits for the forward)
    logits.view(-1).index_fill_(0, _index_on(worker.device, single * vocab + forced[single]), 0.0)
    for i in np.flatnonzero(few).tolist():
        tokens, row = allowed_ids(bitmask[i], vocab), int(rows[i])
        logits[row, torch.from_numpy(tokens)] = worker.model.compute_chosen_logits(hidden[row : row + 1], tokens)[0]
    masked = (forced[rows] < 0) & ~few  # the other guided rows: their mask as usual
    return logits, (rows[masked], bitmask[masked])


def greedy_masked(
    worker: Worker, hidden: torch.Tensor, mask: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray] | None:
    """Greedy rows of a step with a bitmask, on the CPU: (a token per logits row, ones) on rank 0,
    None elsewhere (``verify.accept_greedy`` then accepts each row's drafts by them). A logits
    row whose mask allows one token is that token, with no logits at all; a row whose mask
    allows few has only theirs computed (``_logits_and_masks`` says where); the others get the LM
    head and a pick that reads their mask in place. No [rows, vocab] array is made beyond the LM
    head's own output, and each pick is the one ``verify`` makes of the masked logits (the first
    of equal maxima, NO_TOKEN where nothing is allowed)."""
    rows, bitmask = mask
    num_rows = hidden.shape[0]
    forced, few = _settled_rows(worker, rows, bitmask, num_rows)
    whole = forced < 0
    whole[rows[few]] = False
    keep = np.flatnonzero(whole)
    picked = None
    if len(keep) == num_rows:  # (every row's LM head, as a regex's rows mostly need: the mask as it came)
        rows_masked, kept = mask, hidden
    elif len(keep):
        position = np.full(num_rows, -1, dtype=np.int64)  # logits row -> its row among ``keep``
        position[keep] = np.arange(len(keep))
        masked = position[rows] >= 0
        rows_masked = (position[rows], bitmask) if masked.all() else (position[rows[masked]], bitmask[masked])
        kept = hidden[_index_on(worker.device, keep)]
    if len(keep):
        picked = worker.model.compute_picks(kept, rows_masked)  # (no logits where the LM head can)
        if picked is None:
            computed = worker.model.compute_logits(kept)
            picked = _argmax_and_dead(computed, rows_masked) if computed is not None else None
    if not worker.tp.is_driver:
        return None
    tokens, dead = forced.copy(), np.zeros(num_rows, dtype=bool)
    if picked is not None:
        tokens[keep], dead[keep] = picked
    for i in np.flatnonzero(few).tolist():
        allowed, row = allowed_ids(bitmask[i], worker.model.cfg.vocab_size), int(rows[i])
        chosen = worker.model.compute_chosen_logits(hidden[row : row + 1], allowed)[0]
        tokens[row] = allowed[int(chosen.argmax())]  # (ascending ids: the first maximum, as argmax over the row)
    tokens = tokens.astype(np.int32)
    tokens[dead] = NO_TOKEN
    return tokens, np.ones(num_rows, dtype=np.int32)


def _settled_rows(
    worker: Worker, rows: np.ndarray, bitmask: np.ndarray, num_rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """(per logits row: the one token its mask allows or -1; per bitmask row: whether its tokens'
    logits are computed alone). Counting every row's tokens costs a pass over its words (8,192
    a row at a 262k vocabulary): done only where the model computes chosen logits."""
    vocab = worker.model.cfg.vocab_size
    if not worker.model.computes_chosen_logits:
        return only_allowed(rows, bitmask, num_rows, vocab), np.zeros(len(rows), dtype=bool)
    counts = allowed_counts(bitmask)
    few = (counts > 1) & (counts <= vocab // _FEW_TOKENS)
    return only_allowed(rows, bitmask, num_rows, vocab, counts), few


def _index_on(device: torch.device, array: np.ndarray) -> torch.Tensor:
    """An index array on ``device``, copied without waiting for the stream (a blocking copy from
    pageable memory would wait for the forward's kernels first)."""
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device, non_blocking=True)


def _drafts(inputs: StepInputs) -> list[np.ndarray]:
    """Each row's draft tokens: the last ``num_logits - 1`` tokens it runs."""
    ends = np.cumsum(inputs.num_new_tokens)
    return [inputs.token_ids[end - max(0, n - 1) : end] for end, n in zip(ends.tolist(), inputs.num_logits.tolist())]


class _StepProfiler:
    """torch's profiler over the steps during which ``folder/on`` exists (envs.torch_profiler_dir),
    with Python stacks (each op's callers are in its window's Chrome trace)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.windows = folder, 0
        self.active: Any = None

    def tick(self) -> None:
        on = (self.folder / "on").exists()
        if on and self.active is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.active = torch.profiler.profile(activities=activities, with_stack=True)
            self.active.__enter__()
        elif not on and self.active is not None:
            self.active.__exit__(None, None, None)
            self.active.export_chrome_trace(str(self.folder / f"rank0-{self.windows}.json"))
            self.active, self.windows = None, self.windows + 1
