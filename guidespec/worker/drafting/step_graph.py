"""A whole speculative step of a model drafter as one fixed-shape graph (rank 0): the
target's verify forward, the wait for the step's verify masks, acceptance on the device, the
drafter following the step's positions and the next step's draft steps, grammar waits inside.

    target forward over B rows x n tokens (the last accepted token, then the drafts)
    LM head;  [guided] wait for the verify masks (C);  copy them host-to-device;  -inf where forbidden
    greedy rows: picks = argmax;  accepted = leading drafts equal to the picks;  count = accepted + 1
    sampled rows: rejection sampling of their one-hot drafts (verify.verify_padded)
    follow:  EAGLE: head forward over the n positions (the target's features, the picks as next tokens)
             draft model with a cache of its own: its forward over the step's n tokens
             draft model sharing the target's cache: nothing (the target's forward wrote it)
    the draft steps (draft_graph.py), from each row's last produced position (EAGLE: the head's
        output there) or its newest token, the last pick, one position further (a draft model)
    copy picks, counts and drafts device-to-host

The scheduler fills the verify masks while the target's layers run, as it does for a step that
is not fused, and writes them into the draft channel as well as the ring (tag (step, VERIFY),
before the step's draft 0): ``gs_cb_verify_wait`` lays them out at the graph rows of their
logits rows (all ones for unguided rows). The head runs over every position of a row, the
rejected ones too, with the target's own picks as the tokens that follow: at an accepted
position the pick is the draft, at the last produced one it is the bonus token, and what the
rejected positions write into the head's cache lies past the row's end, rewritten before it is
read (as the target's rejected keys are). So the head's cache after the step holds what the
step-by-step path (``EagleRunner.propose``) writes, and its drafts are the same; a draft model's
cache likewise (``DraftRunner.propose``).

A step runs fused when every row is a verify step (a row with penalties too: its token history is
recorded and applied on the device, ``TokenHistory.update_padded``), greedy or sampled
(rejection sampling on the device, ``verify.verify_padded``: where steps fuse the drafters
draft their argmax for every row, so a sampled row's q' is one-hot; the uniforms are drawn in the
graph, a seeded row's computed on the host from its seed and copied in, so it draws what a step
by step would), drafting at most
``MAX_GRAPH_DRAFTS`` (or none: where the adaptive plan drafts for no row, the head still
follows, so its cache never falls behind); others run step by step. Positions of its rows the
head has not followed yet (a row the adaptive plan held back, a step without logits, a prefill
chunk's last position) run through the drafter eagerly first (``catch_up``). The
decision reads the step's inputs alone, so tensor-parallel ranks agree: the other ranks run the
target's part of the graph (:class:`FusedStepFollower`), whose collectives match rank 0's. On CUDA each
:class:`StepGraphKey` is captured once and replayed; on the CPU the same sequence runs eagerly
with the trampolines called where they stand (the target's ordinary forward, the CPU's own
kernels, laid out padded: the padded forward is ``graphs.py``'s, tested on its own), so CI checks
the layouts, the protocol and the outputs against the step-by-step path. A failed verify-mask
wait (the scheduler died, or sent rows this graph does not have) forbids every token and fails
the step after the replay; a failed draft-step wait drops the step's proposals, as the draft
graph does.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from guidespec.cuda_ext.channel import OK, VERIFY, DraftChannelError
from guidespec.cuda_ext.host_functions import VerifyWaitArgs
from guidespec.protocol import StepInputs
from guidespec.worker.drafting.draft_graph import (
    MAX_GRAPH_DRAFTS,
    MAX_PRODUCED,
    DraftGraphKey,
    DraftGraphs,
    _DraftGraph,
)
from guidespec.worker.verify import seeded_uniforms, verify_padded
from guidespec.worker.graphs import (
    MAX_GRAPH_TOKENS,
    GraphKey,
    StaticBuffers,
    batch_bucket,
    capture_graph,
    key_bucket,
    padded_forward,
    tokens_bucket,
)
from guidespec.worker.kv_cache import KVCache
from guidespec.worker.penalties import TokenHistory
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.model import LlamaModel

logger = logging.getLogger(__name__)


class FusedDrafter(Protocol):
    """What a fused step needs of rank 0's model drafter (``EagleRunner``, ``DraftRunner``)."""

    graphs: DraftGraphs | None  # its draft steps as graphs (``use_graphs``)

    @property
    def capture(self) -> tuple[int, ...] | str | None:
        """The target features it reads (None: none)."""
        ...

    def catch_up(self, inputs: StepInputs) -> int:
        """Run the positions of the step's rows it has not followed yet; their number."""
        ...

    def follow_padded(
        self, features: torch.Tensor | None, picks: torch.Tensor, buffers: StaticBuffers, key: GraphKey
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Follow the step laid out padded in ``buffers`` (``picks`` [B * n]: the target's pick at
        each position); an EAGLE head returns its (output, draft logits) of every position."""
        ...


@dataclass(frozen=True)
class StepGraphKey:
    verify: GraphKey  # (B, n, L) of the target's forward and the drafter's follow
    drafts: DraftGraphKey  # (B, K, L', masked steps) of the draft steps
    guided: bool  # the step has verify masks: the graph waits for them
    sampled: bool  # a row samples: rejection sampling on the device (worker/verify.py)
    penalized: bool  # a row asks for penalties: its token history recorded and applied on the device


@dataclass
class FusedOutputs:
    tokens: np.ndarray  # [sum(counts)] int32: each row's produced tokens
    counts: np.ndarray  # [rows] int32
    proposals: tuple[np.ndarray, np.ndarray] | None  # (flat drafts, per-row counts); None: a draft wait failed
    draft_s: float  # the draft steps' part of the step (the adaptive plan's draft cost learns from it)
    mask_waits: np.ndarray  # [m, 3] float64: (VERIFY or draft index, wait start, wait end), wall seconds


def fusable(inputs: StepInputs, max_batch_size: int, max_logits_rows: int, max_model_len: int) -> bool:
    """Whether a step runs fused: every row a verify step (its every token's logits wanted),
    greedy or sampled, penalties or not, few enough drafts, tokens and rows. Read from the step's
    inputs alone, so every tensor-parallel rank decides alike: rank 0 runs the whole step, the
    others its target part (:class:`FusedStepFollower`), and their collectives match."""
    n_rows = inputs.batch_size
    if inputs.draft_lens is None or not 0 < n_rows <= max_batch_size:
        return False
    new, logits = inputs.num_new_tokens, inputs.num_logits
    if not ((new == logits) & (logits >= 1)).all() or int(logits.sum()) > max_logits_rows:
        return False
    k, n = int(inputs.draft_lens.max()), tokens_bucket(int(new.max()))
    b = batch_bucket(n_rows, max_batch_size)
    if not 0 <= k <= MAX_GRAPH_DRAFTS or n is None or b is None or b * n > MAX_GRAPH_TOKENS:
        return False
    starts = inputs.start_positions
    return not ((starts <= 0).any() or int((starts + new).max()) + k + 2 > max_model_len)


def step_key(inputs: StepInputs, max_batch_size: int, max_model_len: int) -> StepGraphKey:
    """The graph a :func:`fusable` step replays (every rank computes the same key)."""
    n, b = tokens_bucket(int(inputs.num_new_tokens.max())), batch_bucket(inputs.batch_size, max_batch_size)
    assert n is not None and b is not None and inputs.draft_lens is not None
    end, k = int((inputs.start_positions + inputs.num_new_tokens).max()), int(inputs.draft_lens.max())
    masked = min(k, int(inputs.draft_masked.max())) if inputs.draft_masked is not None else 0
    return StepGraphKey(
        GraphKey(b, n, key_bucket(end, max_model_len)),
        DraftGraphKey(b, k, key_bucket(end + k, max_model_len), masked),
        inputs.has_bitmask,
        bool((inputs.temperature > 0).any()),
        bool(inputs.penalized.any()),
    )


class _StepGraph:
    def __init__(self, key: StepGraphKey, owner: StepGraphs) -> None:
        self.key, self.owner = key, owner
        b, n = key.verify.batch, key.verify.tokens_per_row
        device, pin = owner.device, owner.device.type == "cuda"
        self.buffers = StaticBuffers(key.verify, device, owner.scratch_slot)
        self.drafts = _DraftGraph(key.drafts, owner.draft_graphs, first_published=True)
        self.draft_count = torch.zeros(b, dtype=torch.long, device=device)  # real drafts of each row
        # sampled keys: each row's (temperature, top-k, top-p); penalized keys: each row's
        # (repetition, frequency, presence) and prompt length (0: a row without); padding neutral
        self.sampling = torch.tensor([0.0, 0.0, 1.0], device=device)[:, None].repeat(1, b)
        self.penalties = torch.tensor([1.0, 0.0, 0.0], device=device).repeat(b, 1)
        self.prompt_lens = torch.zeros(b, dtype=torch.long, device=device)
        # seeded sampled rows: their numbers (counter-based, computed on the host) replace the draws
        self.seeded = torch.zeros(b, dtype=torch.bool, device=device)
        self.seeded_uniforms = torch.zeros(b, 2, n, device=device)
        self.produced = torch.zeros(b, MAX_PRODUCED, dtype=torch.int32, device=device)
        words = owner.draft_graphs.num_words
        self.mask = torch.zeros(b * n, words, dtype=torch.int32, device=device)
        self.host_mask = torch.zeros(b * n, words, dtype=torch.int32, pin_memory=pin)
        self.padded_of = torch.full((owner.max_logits_rows,), -1, dtype=torch.int32, pin_memory=pin)
        self.verify_status = torch.zeros(1, dtype=torch.int32, pin_memory=pin)
        self.verify_times = torch.zeros(2, dtype=torch.int64, pin_memory=pin)  # the wait's start, end (wall ns)
        self.verify_enabled = torch.zeros(1, dtype=torch.int32, pin_memory=pin)
        self.out_picks = torch.zeros(b, n, dtype=torch.int32, pin_memory=pin)
        self.out_counts = torch.zeros(b, dtype=torch.int32, pin_memory=pin)
        self.out_drafts = torch.zeros(key.drafts.drafts, b, dtype=torch.int32, pin_memory=pin)
        host = owner.draft_graphs.host
        self.verify_args = VerifyWaitArgs(
            owner.draft_graphs.channel.base,
            host.address("step"),
            int(owner.verify_timeout_s * 1e6),
            owner.draft_graphs.peer_pid,
            b * n,
            words,
            owner.max_logits_rows,
            ctypes.c_void_p(self.padded_of.data_ptr()),
            ctypes.c_void_p(self.verify_enabled.data_ptr()),
            ctypes.c_void_p(self.host_mask.data_ptr()),
            ctypes.c_void_p(self.verify_status.data_ptr()),
            ctypes.c_void_p(self.verify_times.data_ptr()),
        )
        self.graph: Any = None  # the verify part (CUDA); the draft steps are a second graph, replayed
        self.draft_graph: Any = None  # right after it, so a timing event can stand between them
        self.batch: ForwardBatch | None = None  # eagerly: this step's batch, and where its tokens
        self.real: torch.Tensor | None = None  # sit in the padded layout

    def steps(self) -> None:
        """The step, as the graphs replay it: writes ``out_picks``, ``out_counts``, ``out_drafts``."""
        self.verify_steps()
        self.draft_steps()

    def verify_steps(self) -> None:
        """The first part: the target's verify forward, its masks, acceptance, the drafter's follow,
        and the draft steps' inputs."""
        owner, key, buffers = self.owner, self.key, self.buffers
        b, n = key.verify.batch, key.verify.tokens_per_row
        runner, target = owner.runner, owner.target
        if self.graph is not None or owner.capture:
            hidden = padded_forward(target, owner.kv, buffers, runner.capture)
            features = target.captured
        else:  # eagerly: the target's ordinary forward (the CPU's own kernels), laid out padded
            assert self.batch is not None and self.real is not None
            real = target.forward(self.batch, owner.kv, runner.capture)
            hidden = real.new_zeros(b * n, real.shape[-1]).index_copy_(0, self.real, real)
            features = None
            if target.captured is not None:
                features = target.captured.new_zeros(b * n, target.captured.shape[-1])
                features.index_copy_(0, self.real, target.captured)
        logits = target.compute_logits(hidden)
        assert logits is not None
        if key.guided:
            owner.draft_graphs.host_functions.enqueue("gs_cb_verify_wait", self.verify_args)
            self.mask.copy_(self.host_mask, non_blocking=True)
            vocab = logits.shape[-1]
            allowed = ((self.mask[:, :, None] >> owner.bits) & 1).view(b * n, -1)[:, :vocab].bool()
            logits = logits.masked_fill(~allowed, float("-inf"))
        if key.penalized:  # (after the masks, as the unfused step: -inf stays -inf)
            history = owner.history
            assert history is not None, "a penalized step fused without the worker's token history"
            history.update_padded(
                buffers.token_ids, buffers.token_slots, buffers.positions, self.prompt_lens.repeat_interleave(n)
            )
            penalties = self.penalties.repeat_interleave(n, dim=0)
            logits = history.apply_padded(logits, buffers.row_slots.repeat_interleave(n), *penalties.unbind(1))
        sampling = None
        if key.sampled:  # (uniforms drawn in the graph: each replay draws new ones; a seeded row's its own)
            uniforms = torch.rand(b, 2, n, device=logits.device, generator=owner.generator)
            uniforms = torch.where(self.seeded[:, None, None], self.seeded_uniforms, uniforms)
            temperature, top_k, top_p = self.sampling
            sampling = (temperature, top_k.long(), top_p, uniforms)
        # picks: each row's produced tokens first (its accepted drafts, then its own token)
        picks, counts = verify_padded(logits, buffers.token_ids.view(b, n)[:, 1:], self.draft_count, sampling)
        if key.drafts.drafts and key.drafts.masked_steps:
            # draft step 0's publish (the produced tokens) goes out now: the scheduler fills mask 0
            # while the drafter follows, where after the follow the device would stand waiting for it
            host = owner.draft_graphs.host
            self.produced[:, :n].copy_(picks)
            host.produced[: b * MAX_PRODUCED].copy_(self.produced.view(-1), non_blocking=True)
            host.produced_len[:b].copy_(counts.to(torch.int32), non_blocking=True)
            owner.draft_graphs.host_functions.enqueue("gs_cb_graph_publish", self.drafts.args[0])
        followed = runner.follow_padded(features, picks.clamp(min=0).view(-1), buffers, key.verify)
        self.out_picks.copy_(picks, non_blocking=True)
        self.out_counts.copy_(counts, non_blocking=True)
        if key.drafts.drafts == 0:  # no row drafts this step (the adaptive plan): the drafter only follows
            return
        last = torch.arange(b, device=picks.device) * n + counts - 1  # each row's last produced position
        graph = self.drafts
        if followed is None:  # a draft model: the graph runs the newest token, one position further
            graph.first.copy_(picks.clamp(min=0).view(-1).index_select(0, last))
            graph.positions.copy_(buffers.positions.index_select(0, last) + 1)
        else:  # an EAGLE head: its output at the last produced position gives draft 0
            graph.features.copy_(followed[0].index_select(0, last))
            graph.logits.copy_(followed[1].index_select(0, last))
            graph.positions.copy_(buffers.positions.index_select(0, last))
        graph.slots.copy_(buffers.row_slots)

    def draft_steps(self) -> None:
        """The second part: the draft steps (``draft_graph.py``), where a row drafts."""
        if self.key.drafts.drafts:
            self.out_drafts.copy_(self.drafts.steps(), non_blocking=True)

    def capture(self) -> None:
        """Warm up (every row padding: nothing published or awaited), then capture both parts."""
        device, pool = self.owner.device, self.owner.draft_graphs.pool
        self.graph = capture_graph(device, pool, self.verify_steps)
        if self.key.drafts.drafts:
            self.draft_graph = capture_graph(device, pool, self.draft_steps)
        logger.info("captured a fused step graph for %s (%d graphs)", self.key, len(self.owner.graphs))


class StepGraphs:
    """Fused steps of a model drafter, greedy and sampled rows (rank 0). ``runner``: the
    worker's EagleRunner or DraftRunner with its draft graphs (``use_graphs``); ``kv``: the
    target's cache, its last slot the scratch slot."""

    def __init__(
        self,
        runner: FusedDrafter,
        target: LlamaModel,
        kv: KVCache,
        max_logits_rows: int,
        verify_timeout_s: float,
        history: TokenHistory | None = None,
    ) -> None:
        draft_graphs: DraftGraphs | None = runner.graphs
        if draft_graphs is None:
            raise ValueError("fused steps need the drafter's draft graphs (use_graphs)")
        if kv.num_slots - 1 != draft_graphs.scratch_slot:
            scratch = draft_graphs.scratch_slot
            raise ValueError(f"scratch slots differ: {kv.num_slots - 1} (target), {scratch} (drafter)")
        self.runner, self.target, self.kv, self.draft_graphs = runner, target, kv, draft_graphs
        if history is not None and history.seen.shape[0] != kv.num_slots:
            raise ValueError(f"the token history holds {history.seen.shape[0]} slots, not {kv.num_slots}")
        self.history = history  # penalties (rank 0's, the worker's): its last slot the scratch slot
        self.device = draft_graphs.device
        self.scratch_slot = draft_graphs.scratch_slot
        self.max_batch_size, self.max_model_len = draft_graphs.max_batch_size, target.max_model_len
        if draft_graphs.channel.layout.max_rows < max_logits_rows:  # (every rank must fuse the same steps)
            raise ValueError(
                f"the draft channel holds {draft_graphs.channel.layout.max_rows} rows, not {max_logits_rows}"
            )
        self.max_logits_rows = max_logits_rows
        self.verify_timeout_s = verify_timeout_s
        self.capture = draft_graphs.capture
        self.bits = torch.arange(32, dtype=torch.int32, device=self.device)  # (made here, not in a capture)
        # sampled rows' uniforms: on CUDA the default generator (graph-safe: a replay draws anew),
        # seeded here from the OS; on the CPU one of the step's own
        seed = int.from_bytes(os.urandom(7), "little")
        self.generator: torch.Generator | None = None
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(seed)
        else:
            self.generator = torch.Generator().manual_seed(seed)
        # around a replay: its verify part, then its draft steps (the adaptive plan's two costs)
        cuda = self.device.type == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if self.capture and cuda else []
        self.graphs: dict[StepGraphKey, _StepGraph] = {}

    def fits(self, inputs: StepInputs) -> bool:
        return fusable(inputs, self.max_batch_size, self.max_logits_rows, self.max_model_len)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> FusedOutputs:
        """Run a step that :meth:`fits`. DraftChannelError where its verify masks did not come."""
        n_rows = inputs.batch_size
        batch = ForwardBatch.create(
            inputs.token_ids, inputs.slots, inputs.start_positions, inputs.num_new_tokens, inputs.num_logits
        )
        assert inputs.draft_lens is not None
        wanted = inputs.draft_lens.astype(np.int32)
        masked = inputs.draft_masked.astype(np.int32) if inputs.draft_masked is not None else np.zeros(n_rows, np.int32)
        key = step_key(inputs, self.max_batch_size, self.max_model_len)
        self.runner.catch_up(inputs)  # (the graph's drafter follows the step's positions only)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = _StepGraph(key, self)
            if self.capture:  # on padding only: nothing published, nothing waited for
                self._write_padding(graph)
                graph.capture()
            else:
                logger.info("fused steps for %s run eagerly, as a graph would (%d shapes)", key, len(self.graphs))
        self._write(graph, inputs, batch, wanted, masked)
        if graph.graph is not None:
            draft_s = self._replay(graph)
        else:
            graph.verify_steps()
            drafting = time.perf_counter()
            graph.draft_steps()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            draft_s = time.perf_counter() - drafting
        verify_code = int(graph.verify_status[0])
        if verify_code != OK:
            raise DraftChannelError(verify_code, inputs.step, VERIFY, "waiting for the step's verify masks")
        picks, counts = graph.out_picks[:n_rows].numpy(), graph.out_counts[:n_rows].numpy().copy()
        tokens = np.concatenate([picks[i, : counts[i]] for i in range(n_rows)]).astype(np.int32)
        publish_code, wait_code = self.draft_graphs.host.status.tolist()
        proposals = None
        if publish_code == OK and wait_code == OK:
            chains = graph.out_drafts[:, :n_rows].numpy()
            flat = [chains[: wanted[i], i] for i in range(n_rows)]
            proposals = (np.concatenate(flat).astype(np.int32), wanted.copy())
        else:
            code, _, index = self.draft_graphs.channel.last_error()
            error = DraftChannelError(code, inputs.step, index, "drafting")
            logger.warning("worker rank 0: %s; no drafts this step", error)
        start, end = (int(t) for t in graph.verify_times)
        waits = [(float(VERIFY), start / 1e9, end / 1e9)] if end > 0 else []
        waits += self.draft_graphs.waits(graph.key.drafts.drafts)
        return FusedOutputs(tokens, counts, proposals, draft_s, np.array(waits, dtype=np.float64).reshape(-1, 3))

    def _replay(self, graph: _StepGraph) -> float:
        """Replay the step's two graphs; the seconds of the draft steps' one, between timing events
        (the clock where the graphs are the tests' stand-ins on the CPU)."""
        if self.device.type != "cuda":
            graph.graph.replay()
            started = time.perf_counter()
            if graph.draft_graph is not None:
                graph.draft_graph.replay()
            return time.perf_counter() - started
        start, middle, end = self.events
        start.record()
        graph.graph.replay()
        middle.record()
        if graph.draft_graph is not None:
            graph.draft_graph.replay()
        end.record()
        torch.cuda.current_stream(self.device).synchronize()  # (the copies out are asynchronous)
        return float(middle.elapsed_time(end)) / 1e3

    def _write(
        self, graph: _StepGraph, inputs: StepInputs, batch: ForwardBatch, wanted: np.ndarray, masked: np.ndarray
    ) -> None:
        n_rows, b = inputs.batch_size, graph.key.verify.batch
        index, real = graph.buffers.write(batch, self.max_model_len)
        if not self.capture:  # (the eager path's ordinary forward)
            graph.batch, graph.real = batch, torch.from_numpy(real).to(self.device)
        graph.padded_of[:] = -1
        graph.padded_of[: len(index)] = torch.from_numpy(index.astype(np.int32))
        draft_count = np.zeros(b, dtype=np.int64)
        draft_count[:n_rows] = inputs.num_logits - 1
        graph.draft_count.copy_(torch.from_numpy(draft_count), non_blocking=True)
        if graph.key.penalized:  # (padding rows: neutral at first, later stale; their results are never read)
            graph.penalties[:n_rows].copy_(torch.from_numpy(inputs.penalties), non_blocking=True)
            prompt_lens = np.where(inputs.penalized, inputs.num_prompt_tokens, 0)
            graph.prompt_lens[:n_rows].copy_(torch.from_numpy(prompt_lens), non_blocking=True)
        if graph.key.sampled:
            params = np.stack([inputs.temperature, inputs.top_k, inputs.top_p]).astype(np.float32)
            graph.sampling[:, :n_rows].copy_(torch.from_numpy(params), non_blocking=True)
            seeded = (inputs.temperature > 0) & (inputs.seeds >= 0)
            graph.seeded[:n_rows].copy_(torch.from_numpy(seeded), non_blocking=True)
            if seeded.any():
                n = graph.key.verify.tokens_per_row
                numbers = seeded_uniforms(inputs.seeds[seeded], inputs.sample_index[seeded], n)
                rows = torch.from_numpy(np.flatnonzero(seeded)).to(self.device)
                graph.seeded_uniforms.index_copy_(0, rows, torch.from_numpy(numbers).to(self.device))
        graph.verify_status.zero_()
        graph.verify_times.zero_()
        graph.verify_enabled[0] = 1
        host = self.draft_graphs.host
        host.step[0] = inputs.step
        host.status.zero_()
        host.times.zero_()
        host.batch_rows[:n_rows] = torch.arange(n_rows, dtype=torch.int32)
        host.wanted[:n_rows], host.wanted[n_rows:b] = torch.from_numpy(wanted), 0
        host.masked[:n_rows], host.masked[n_rows:b] = torch.from_numpy(masked), 0

    def _write_padding(self, graph: _StepGraph) -> None:
        """Every row padding (what a warm-up and a capture run on): nothing published or awaited."""
        b = graph.key.verify.batch
        graph.buffers.fill_padding()
        graph.verify_enabled[0] = 0
        graph.draft_count.zero_()
        host = self.draft_graphs.host
        host.wanted[:b], host.masked[:b] = 0, 0
        host.status.zero_()


class FusedStepFollower:
    """A fused step on a tensor-parallel rank other than 0: the target's part of rank 0's graph,
    the same padded forward and LM head, so their collectives (the layers' all-reduces, the
    logits' gather onto rank 0) match; masks, acceptance and the drafter are rank 0's alone. On CUDA
    captured per :class:`StepGraphKey`, at the steps where rank 0 captures its graph (the same
    warm-up runs, the same collectives); on the CPU the ordinary forward laid out padded, as rank
    0 runs it there."""

    def __init__(
        self, target: LlamaModel, kv: KVCache, max_batch_size: int, max_logits_rows: int, capture: bool
    ) -> None:
        self.target, self.kv = target, kv
        self.max_batch_size, self.max_logits_rows = max_batch_size, max_logits_rows
        self.device, self.capture = torch.device(target.device), capture
        self.scratch_slot = kv.num_slots - 1
        self.pool: Any = torch.cuda.graph_pool_handle() if capture else None
        self.buffers: dict[StepGraphKey, StaticBuffers] = {}
        self.graphs: dict[StepGraphKey, Any] = {}

    def fits(self, inputs: StepInputs) -> bool:
        return fusable(inputs, self.max_batch_size, self.max_logits_rows, self.target.max_model_len)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> None:
        """The target's part of a step that :func:`fusable` says rank 0 runs fused."""
        batch = ForwardBatch.create(
            inputs.token_ids, inputs.slots, inputs.start_positions, inputs.num_new_tokens, inputs.num_logits
        )
        key = step_key(inputs, self.max_batch_size, self.target.max_model_len)
        buffers = self.buffers.get(key)
        if buffers is None:
            buffers = self.buffers[key] = StaticBuffers(key.verify, self.device, self.scratch_slot)
            if self.capture:  # on padding, as rank 0 captures its graph
                self.graphs[key] = capture_graph(self.device, self.pool, lambda: self._padded(buffers))
        _, real = buffers.write(batch, self.target.max_model_len)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            hidden = self.target.forward(batch, self.kv)
            padded = hidden.new_zeros(key.verify.batch * key.verify.tokens_per_row, hidden.shape[-1])
            self.target.compute_logits(padded.index_copy_(0, torch.from_numpy(real).to(self.device), hidden))

    def _padded(self, buffers: StaticBuffers) -> None:
        self.target.compute_logits(padded_forward(self.target, self.kv, buffers))
