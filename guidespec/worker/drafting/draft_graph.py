"""Greedy draft steps of a model drafter as one fixed-shape graph, grammar waits inside (rank 0).

A proposal's draft steps run, for ``B`` rows (the rows drafting, rounded up to a batch bucket)
and ``K`` drafts (the most any row wants), as one sequence of operations that never returns to
Python between draft steps:

    for j in 0..K-1:
        [guided] [j > 0] copy draft j-1 device-to-host;  publish the drafts so far (C)
                 (a fused step publishes draft 0 earlier, before the drafter follows the step)
        [j > 0, or a draft model] drafter forward over token j at position p + j
        [guided] wait for mask j (C);  copy it host-to-device;  -inf where it forbids
        draft j = argmax (as target ids, through d2t for a pruned EAGLE vocabulary)

The drafter (:class:`GraphDrafter`) is an EAGLE head (``eagle.py``: its forward reads its own
last output and the token; draft 0 comes from the follow run's output at the row's last final
position ``p``, so step 0 runs no forward) or a draft model (``draft_model.py``: token 0 is the
row's newest token, at position ``p``, whose forward gives draft 0 — so draft 0's mask is filled
while that forward runs too; token j > 0 is draft j-1).

"publish" and "wait" are the draft channel's C trampolines (``gs_cb_graph_publish`` and
``gs_cb_graph_wait`` in ``cuda_ext/draft_channel.c``), enqueued in stream order by
:class:`~guidespec.cuda_ext.host_functions.HostFunctions`. The head forward stands between them:
it needs draft j-1, not mask j, so the scheduler fills mask j while it runs, and the wait finds
the mask there or nearly (the grammar work hides behind the head's forward, as the target
step's masks hide behind the target's). On CUDA the sequence is captured once
per :class:`DraftGraphKey` into a CUDA graph (host nodes for the trampolines) and replayed; on
the CPU the same sequence runs eagerly, the trampolines called where they stand, so CI runs the
protocol, the layouts and the error handling a GPU replays.

The graph reads fixed buffers: device tensors (the head's output and draft logits at each row's
last final position, positions, slots) and host buffers the trampolines read (the step number,
each row's batch row, wanted drafts, masked draft steps, tokens produced this step), page-locked on
CUDA. Rows wanting fewer than ``K`` drafts draft on (their extra picks are cut on the host, and
the scheduler is asked only for the masks of drafts a row wants); padding rows run on the
head's scratch slot. A failed wait (timeout, a dead scheduler, a stale mask) forbids every token
of the rows it concerns, and every later draft step of the replay asks for nothing and forbids
every token of its guided rows; the error is read after the replay and the proposal dropped, as
the step-by-step path does. Sampled rows keep that path (their draws and q' are host-side),
except where steps fuse: there every row drafts its argmax (``DraftSampling.greedy``), in graphs.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from guidespec.cuda_ext.channel import OK, DraftChannel, DraftChannelError
from guidespec.cuda_ext.host_functions import GraphStepArgs, HostFunctions
from guidespec.worker.graphs import batch_bucket, capture_graph, key_bucket
from guidespec.worker.kv_cache import KVCache

logger = logging.getLogger(__name__)
MAX_GRAPH_DRAFTS = 8  # more drafts per row run step by step
MAX_PRODUCED = 64  # tokens a row produced this step, at most, for a graph (more: step by step)


class GraphDrafter(Protocol):
    """What the draft graphs run: one draft step over ``B`` rows of one token each."""

    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    feature_width: int  # the state one draft step hands the next (an EAGLE head's output hidden)
    logits_width: int  # the draft vocabulary
    forwards_first: bool  # draft 0 needs a forward (a draft model's newest token), not the follow run's output

    def draft_step(
        self,
        features: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv: KVCache,
        key_length: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [B, feature_width], draft logits [B, logits_width]) after ``token_ids`` [B] at
        ``positions`` [B] of ``slots`` [B], attending the first ``key_length`` keys; capturable."""
        ...

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class DraftGraphKey:
    batch: int  # B: rows
    drafts: int  # K: draft steps
    key_length: int  # L: keys attended
    masked_steps: int  # draft steps that wait for a grammar mask, from the first (0: no host functions at all)


class _HostBuffers:
    """What the trampolines read and write, for the largest graph (page-locked on CUDA); a graph
    of ``B`` rows uses each buffer's first rows with stride ``B``."""

    def __init__(self, max_rows: int, num_words: int, pin: bool) -> None:
        def make(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        b, w = max_rows, num_words
        self.step = make(1, dtype=torch.int64)
        self.batch_rows, self.wanted, self.masked, self.produced_len = (make(b) for _ in range(4))
        self.produced = make(b * MAX_PRODUCED)
        self.drafts = make(MAX_GRAPH_DRAFTS * b)
        self.rows, self.lens = make(b), make(b)
        self.tokens = make(b * (MAX_PRODUCED + MAX_GRAPH_DRAFTS))
        self.mask_rows, self.out = make(b * w), make(b * w)
        self.published, self.status = make(1), make(2)
        # per draft step: when it published, when its mask's wait began and ended (wall ns; 0: none)
        self.times = make(MAX_GRAPH_DRAFTS, 3, dtype=torch.int64)

    def address(self, name: str) -> ctypes.c_void_p:
        return ctypes.c_void_p(getattr(self, name).data_ptr())


class _DraftGraph:
    """The buffers, argument blocks and (on CUDA) the captured graph of one key. ``first_published``:
    draft step 0's publish is enqueued before these steps run (a fused step does it as soon as the
    step's produced tokens are known, so the scheduler fills mask 0 while the drafter follows)."""

    def __init__(self, key: DraftGraphKey, owner: DraftGraphs, first_published: bool = False) -> None:
        self.key, self.owner, self.first_published = key, owner, first_published
        drafter, device, b = owner.drafter, owner.device, key.batch
        self.features = torch.zeros(b, drafter.feature_width, dtype=drafter.dtype, device=device)
        self.logits = torch.zeros(b, drafter.logits_width, dtype=torch.float32, device=device)
        self.first = torch.zeros(b, dtype=torch.long, device=device)  # token 0 (a drafter that forwards first)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slots = torch.full((b,), owner.scratch_slot, dtype=torch.long, device=device)
        self.mask = torch.zeros(b, owner.num_words, dtype=torch.int32, device=device)
        self.picks = torch.zeros(key.drafts, b, dtype=torch.long, device=device)
        host = owner.host
        self.host_drafts = host.drafts[: key.drafts * b].view(key.drafts, b)
        self.host_out = host.out[: b * owner.num_words].view(b, owner.num_words)
        channel = owner.channel
        self.args = [
            GraphStepArgs(
                channel.base,
                host.address("step"),
                j,
                b,
                MAX_PRODUCED,
                owner.num_words,
                int(owner.timeout_s * 1e6),
                owner.peer_pid,
                *(
                    host.address(name)
                    for name in (
                        "batch_rows",
                        "wanted",
                        "masked",
                        "produced",
                        "produced_len",
                        "drafts",
                        "rows",
                        "lens",
                        "tokens",
                        "mask_rows",
                        "out",
                        "published",
                        "status",
                    )
                ),
                ctypes.c_void_p(host.times[j].data_ptr()),
            )
            for j in range(key.drafts)
        ]
        self.graph: Any = None

    def steps(self) -> torch.Tensor:
        """The draft steps, as the graph replays them: writes and returns ``picks`` [K, B]."""
        owner, key, drafter = self.owner, self.key, self.owner.drafter
        out, logits = self.features, self.logits
        for j in range(key.drafts):
            masked = j < key.masked_steps
            if masked:
                if j > 0:  # the tokens the publish trampoline sends: draft j-1 of every row
                    self.host_drafts[j - 1].copy_(self.picks[j - 1].to(torch.int32), non_blocking=True)
                if j > 0 or not self.first_published:
                    owner.host_functions.enqueue("gs_cb_graph_publish", self.args[j])
            if j > 0 or drafter.forwards_first:  # (the scheduler fills mask j meanwhile)
                positions = (self.positions + j).clamp(max=owner.max_model_len - 1)
                token = self.picks[j - 1] if j > 0 else self.first
                out, logits = drafter.draft_step(out, token, positions, self.slots, owner.kv, key.key_length)
            if masked:
                owner.host_functions.enqueue("gs_cb_graph_wait", self.args[j])
                self.mask.copy_(self.host_out, non_blocking=True)
                words = self.mask.index_select(1, owner.mask_word)  # [B, draft vocab]
                allowed = ((words >> owner.mask_bit) & 1).bool() & owner.mask_inside
                logits = logits.masked_fill(~allowed, float("-inf"))
            pick = logits.argmax(dim=-1)
            self.picks[j].copy_(drafter.to_target(pick))
        return self.picks

    def capture(self) -> None:
        """Warm up (every row padding: the trampolines publish nothing), then capture."""
        self.graph = capture_graph(self.owner.device, self.owner.pool, self.steps)
        logger.info("captured a draft-step graph for %s (%d graphs)", self.key, len(self.owner.graphs))


class DraftGraphs:
    """Greedy draft steps of a model drafter as fixed-shape graphs (rank 0). ``kv``: the
    drafter's cache, one slot more than ``max_batch_size`` (the scratch slot padding rows write);
    ``mask_tables``: (word, bit, inside) of each draft id in a target bitmask row."""

    def __init__(
        self,
        drafter: GraphDrafter,
        kv: KVCache,
        max_batch_size: int,
        channel: DraftChannel,
        timeout_s: float,
        peer_pid: int,
        capture: bool,
        mask_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> None:
        if kv.num_slots < max_batch_size + 1:
            raise ValueError(f"draft graphs need a scratch slot: {kv.num_slots} slots for a batch of {max_batch_size}")
        self.drafter, self.kv, self.max_batch_size = drafter, kv, max_batch_size
        self.device = drafter.device
        self.max_model_len = drafter.max_model_len
        self.scratch_slot = kv.num_slots - 1
        self.channel, self.timeout_s, self.peer_pid = channel, timeout_s, peer_pid
        self.num_words = channel.layout.num_words
        self.capture = capture and self.device.type == "cuda"
        self.host = _HostBuffers(max_batch_size, self.num_words, pin=self.device.type == "cuda")
        self.host_functions = HostFunctions(self.device)
        word, bit, inside = mask_tables
        self.mask_word = word.to(self.device, torch.long)
        self.mask_bit = bit.to(self.device, torch.int32)
        self.mask_inside = inside.to(self.device)
        self.graphs: dict[DraftGraphKey, _DraftGraph] = {}
        self.pool: Any = torch.cuda.graph_pool_handle() if self.capture else None
        self.runs = 0
        self._waits: list[tuple[float, float, float]] = []

    def fits(self, rows: np.ndarray, wanted: np.ndarray, temperature: np.ndarray, produced: list[list[int]]) -> bool:
        """Whether these rows' draft steps can run as a graph: greedy, few enough drafts."""
        if not 0 < len(rows) <= self.max_batch_size:
            return False
        k = int(wanted[rows].max())
        return (
            0 < k <= MAX_GRAPH_DRAFTS
            and bool((temperature[rows] <= 0).all())
            and all(len(produced[b]) <= MAX_PRODUCED for b in rows.tolist())
        )

    @torch.inference_mode()
    def run(
        self,
        step: int,
        rows: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        wanted: np.ndarray,
        masked: np.ndarray | None,
        produced: list[list[int]],
        start: tuple[torch.Tensor, torch.Tensor] | np.ndarray,
    ) -> np.ndarray:
        """Drafts [K, n] (target ids) for batch rows ``rows`` (n of them, in order). ``start``: an
        EAGLE head's output and draft logits at their last final positions (``positions``), [n, ...]
        each; for a drafter that forwards first, token 0 of every batch row (its newest token, at
        ``positions``). DraftChannelError where a grammar mask did not come."""
        n = len(rows)
        picked = _Rows(
            rows.astype(np.int32),
            positions[rows].astype(np.int64),
            np.asarray(slots)[rows].astype(np.int64),
            wanted[rows].astype(np.int32),
            masked[rows].astype(np.int32) if masked is not None else np.zeros(n, dtype=np.int32),
            [produced[r] for r in rows.tolist()],
        )
        k = int(picked.wanted.max())
        batch = batch_bucket(n, self.max_batch_size)
        assert batch is not None
        end = int((picked.positions + k).max())
        key = DraftGraphKey(batch, k, key_bucket(end + 1, self.max_model_len), min(k, int(picked.masked.max())))
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = _DraftGraph(key, self)
            if self.capture:  # on padding only: the trampolines publish nothing
                self._write(graph, step, _Rows.none(), np.zeros(0, np.int64))
                graph.capture()
            else:
                logger.info("draft steps for %s run eagerly, as a graph would (%d shapes)", key, len(self.graphs))
        self._write(graph, step, picked, start if isinstance(start, tuple) else start[rows])
        if graph.graph is not None:
            graph.graph.replay()
            picks = graph.picks
        else:
            picks = graph.steps()
        chains = picks[:, :n].cpu().numpy().copy()  # (waits for the replay)
        self.runs += 1
        self._waits += self.waits(k)
        publish_code, wait_code = self.host.status.tolist()
        if publish_code != OK:
            raise DraftChannelError(publish_code, step, -1, "publishing drafts")
        if wait_code != OK:
            _, _, index = self.channel.last_error()
            raise DraftChannelError(wait_code, step, index, "waiting for the scheduler's mask")
        return chains

    def waits(self, drafts: int) -> list[tuple[float, float, float]]:
        """The grammar waits the trampolines timed in the last run of ``drafts`` draft steps:
        (draft index, wait start, wait end), wall-clock seconds."""
        times = self.host.times[:drafts].numpy()
        return [(float(j), times[j, 1] / 1e9, times[j, 2] / 1e9) for j in range(drafts) if times[j, 2] > 0]

    def take_waits(self) -> list[tuple[float, float, float]]:
        """The waits of :meth:`run` since the last call (rank 0's step timeline)."""
        waits, self._waits = self._waits, []
        return waits

    def _write(
        self, graph: _DraftGraph, step: int, rows: _Rows, start: tuple[torch.Tensor, torch.Tensor] | np.ndarray
    ) -> None:
        """Lay ``rows`` out in the graph's first rows and the host buffers; the rest is padding.
        ``start``: the rows' (output, draft logits), or their first tokens."""
        n, b = len(rows.batch_rows), graph.key.batch
        host = self.host
        host.step[0] = step
        host.status.zero_()
        host.times.zero_()
        host.batch_rows[:n] = torch.from_numpy(rows.batch_rows)
        host.wanted[:n], host.wanted[n:b] = torch.from_numpy(rows.wanted), 0
        host.masked[:n], host.masked[n:b] = torch.from_numpy(rows.masked), 0
        lengths = [len(p) for p in rows.produced]
        host.produced_len[:n] = torch.tensor(lengths, dtype=torch.int32)
        grid = np.zeros((n, MAX_PRODUCED), dtype=np.int32)
        for i, tokens in enumerate(rows.produced):
            grid[i, : lengths[i]] = tokens
        host.produced[: n * MAX_PRODUCED] = torch.from_numpy(grid.ravel())
        graph.features.zero_()
        graph.logits.zero_()
        graph.first.zero_()
        if isinstance(start, tuple):
            graph.features[:n].copy_(start[0])
            graph.logits[:n].copy_(start[1])
        else:
            graph.first[:n].copy_(torch.from_numpy(start.astype(np.int64)))
        graph.positions[:n].copy_(torch.from_numpy(rows.positions))
        graph.positions[n:] = 0
        graph.slots[:n].copy_(torch.from_numpy(rows.slots))
        graph.slots[n:] = self.scratch_slot


@dataclass(frozen=True)
class _Rows:
    """The rows one proposal drafts for, in order: each one's batch row, last final position, KV
    slot, drafts wanted, how many of them its grammar masks, and the tokens it produced this step."""

    batch_rows: np.ndarray  # int32
    positions: np.ndarray  # int64
    slots: np.ndarray  # int64
    wanted: np.ndarray  # int32
    masked: np.ndarray  # int32: its draft steps that wait for a grammar mask, from the first
    produced: list[list[int]]

    @staticmethod
    def none() -> _Rows:
        """No rows: every graph row padding (what a warm-up and a capture run on)."""
        i32, i64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
        return _Rows(i32, i64, i64, i32, i32, [])
