"""Decode and speculative-verify steps as CUDA graphs, replayed step after step.

A step whose rows all run few new tokens (decode: 1; verify: 1 + the draft length) runs a
forward of fixed shape (``LlamaModel.forward_padded``) chosen by three buckets:

- ``B``: the batch, rounded up to 1, 2, 4, 8, 16, 32, ... (and the engine's max batch size);
- ``n``: tokens per row, the step's largest row count rounded up to 1, 2, 4, 8, 16 or 32
  (decode: 1; verify: 1 + drafts; a guided row's jump-forward: its forced tokens), where
  ``B x n`` is at most ``MAX_GRAPH_TOKENS``;
- ``L``: keys attended, the longest row's end rounded up to a power of two (at least 256).

Each (B, n, L) is captured once, the first time a step needs it, into a graph that reads a
set of static buffers: the step writes its token ids, positions and slots into them (one
host-to-device copy from a page-locked staging tensor) and replays. Padding is harmless by
construction: padded tokens write their keys into a scratch slot (the cache holds one slot more
than the batch), padded rows read it, and their outputs are never read. Larger steps (prefill
chunks), and every step with ``--enforce-eager``, run the ordinary eager forward.

The same runner without capture (``capture=False``) runs the same padded forward eagerly on any
device: that is what the CPU tests check against the ordinary forward, so bucket choice, static
buffers and padding are tested where there is no GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from guidespec.worker.kv_cache import KVCache
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.model import LlamaModel

logger = logging.getLogger(__name__)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MAX_TOKENS_PER_ROW = 32  # 1 + draft tokens (forced ones included); more runs eagerly
MAX_GRAPH_TOKENS = 2048  # B x n of the largest graph; larger steps run eagerly
MIN_KEY_BUCKET = 256


def batch_bucket(batch_size: int, max_batch_size: int) -> int | None:
    """The smallest bucket holding ``batch_size`` rows (the max batch size is a bucket too)."""
    if not 0 < batch_size <= max_batch_size:
        return None
    return next((b for b in BATCH_BUCKETS if batch_size <= b <= max_batch_size), max_batch_size)


def tokens_bucket(tokens: int, max_tokens_per_row: int = MAX_TOKENS_PER_ROW) -> int | None:
    """Tokens per row of a graph holding rows of at most ``tokens``: a power of two, so a guided
    step's forced tokens (any count) meet a handful of graphs rather than one per count."""
    if not 0 < tokens <= max_tokens_per_row:
        return None
    bucket = 1
    while bucket < tokens:
        bucket *= 2
    return min(bucket, max_tokens_per_row)


def key_bucket(length: int, max_model_len: int) -> int:
    """Keys to attend for rows ending at ``length``: a power of two >= length (>= 256), capped."""
    bucket = MIN_KEY_BUCKET
    while bucket < length:
        bucket *= 2
    return min(bucket, max_model_len)


def capture_graph(device: torch.device, pool: Any, run: Callable[[], object]) -> Any:
    """``run`` twice on a side stream (allocations and lazy initialisation outside the graph), then
    captured into a new ``torch.cuda.CUDAGraph`` in ``pool``."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph


@dataclass(frozen=True)
class GraphKey:
    batch: int  # B: rows
    tokens_per_row: int  # n
    key_length: int  # L


class StaticBuffers:
    """The inputs a graph of one key reads: views of one device tensor, written by one copy from
    a page-locked host tensor: [token ids (B*n) | positions (B*n) | token slots (B*n) | row slots (B)]."""

    def __init__(self, key: GraphKey, device: torch.device, scratch_slot: int) -> None:
        t, b = key.batch * key.tokens_per_row, key.batch
        self.key, self.scratch_slot = key, scratch_slot
        pin = device.type == "cuda"
        self.host = torch.zeros(3 * t + b, dtype=torch.long, pin_memory=pin)
        self.device = torch.zeros(3 * t + b, dtype=torch.long, device=device)
        self.host_np = self.host.numpy()
        self.copied = torch.cuda.Event() if pin else None  # recorded after each copy to the device
        self.token_ids, self.positions, self.token_slots, self.row_slots = self.device.split([t, t, t, b])
        self.fill_padding()

    def fill_padding(self) -> None:
        """Every token and row on the scratch slot (what a capture runs on)."""
        t = self.key.batch * self.key.tokens_per_row
        if self.copied is not None:
            self.copied.synchronize()
        self.host_np[:] = 0
        self.host_np[2 * t :] = self.scratch_slot
        self.host_np[t : 2 * t] = np.tile(np.arange(self.key.tokens_per_row), self.key.batch)
        self.device.copy_(self.host)

    def write(self, batch: ForwardBatch, max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Lay ``batch`` out in the buffers (row i in row i, its tokens first); returns the flat
        index, in the padded layout, of each of the batch's logits rows and of each of its tokens."""
        key, n = self.key, self.key.tokens_per_row
        t = key.batch * n
        if self.copied is not None:
            self.copied.synchronize()
        counts = np.asarray(batch.num_new_tokens, dtype=np.int64)
        starts = np.asarray(batch.start_positions, dtype=np.int64)
        rows = len(counts)
        column = np.arange(n)[None, :]
        real = column < counts[:, None]  # [rows, n]
        tokens = np.zeros((key.batch, n), dtype=np.int64)
        tokens[:rows][real] = batch.token_ids.cpu().numpy()
        positions = np.tile(np.arange(n), (key.batch, 1))
        positions[:rows] = np.minimum(starts[:, None] + column, max_model_len - 1)
        token_slots = np.full((key.batch, n), self.scratch_slot, dtype=np.int64)
        token_slots[:rows][real] = np.repeat(np.asarray(batch.slots, dtype=np.int64), counts)
        row_slots = np.full(key.batch, self.scratch_slot, dtype=np.int64)
        row_slots[:rows] = batch.slots
        out = self.host_np
        out[:t], out[t : 2 * t], out[2 * t : 3 * t], out[3 * t :] = (
            tokens.ravel(),
            positions.ravel(),
            token_slots.ravel(),
            row_slots,
        )
        self.device.copy_(self.host, non_blocking=True)
        if self.copied is not None:  # (the host side is written again once copied: steps overlap)
            self.copied.record()
        flat_of_real = (np.arange(rows)[:, None] * n + column)[real]  # the padded index of each real token
        return flat_of_real[batch.logits_indices.cpu().numpy()], flat_of_real


def padded_forward(
    model: LlamaModel, kv: KVCache, buffers: StaticBuffers, features: tuple[int, ...] | str | None = None
) -> torch.Tensor:
    """``model.forward_padded`` over the step laid out in ``buffers``: [B * n, hidden]."""
    key = buffers.key
    return model.forward_padded(
        kv,
        buffers.token_ids,
        buffers.positions,
        buffers.token_slots,
        buffers.row_slots,
        key.tokens_per_row,
        key.key_length,
        features,
    )


class GraphRunner:
    """Runs steps that fit a bucket as replayed graphs (``capture=True``, CUDA) or as the same
    padded forward run eagerly (``capture=False``). ``kv`` must hold one slot more than the
    batch: the last one is the scratch slot."""

    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        max_batch_size: int,
        capture: bool,
        max_tokens_per_row: int = MAX_TOKENS_PER_ROW,
        features: tuple[int, ...] | str | None = None,
    ) -> None:
        if kv.num_slots < max_batch_size + 1:
            raise ValueError(
                f"a graph runner needs a scratch slot: {kv.num_slots} slots for a batch of {max_batch_size}"
            )
        self.model, self.kv = model, kv
        self.max_batch_size, self.max_tokens_per_row = max_batch_size, max_tokens_per_row
        self.capture = capture
        self.features = features  # an EAGLE head's features, kept in model.captured (LlamaModel.forward)
        self.scratch_slot = kv.num_slots - 1
        self.device = torch.device(model.device)
        self.buffers: dict[GraphKey, StaticBuffers] = {}
        self.graphs: dict[GraphKey, Any] = {}  # key -> (torch.cuda.CUDAGraph, its output, its features)
        self._pool: Any = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0
        self.eager_runs = 0

    def plan(self, batch: ForwardBatch) -> GraphKey | None:
        """The bucket ``batch`` runs in, or None (eager)."""
        n = tokens_bucket(max(batch.num_new_tokens), self.max_tokens_per_row)
        b = batch_bucket(len(batch.slots), self.max_batch_size)
        if n is None or b is None or b * n > MAX_GRAPH_TOKENS:
            return None
        end = max(s + c for s, c in zip(batch.start_positions, batch.num_new_tokens))
        if end > self.model.max_model_len:
            return None
        return GraphKey(b, n, key_bucket(end, self.model.max_model_len))

    def run(
        self, batch: ForwardBatch, key: GraphKey, from_device: tuple[np.ndarray, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Hidden states after the final norm at ``batch.logits_indices``: [R, hidden].
        ``from_device``: (indexes of the batch's tokens, their values on the device), written
        into the graph's inputs on the device (tokens a step before picked, not yet on the host)."""
        buffers = self.buffers.get(key)
        if buffers is None:
            buffers = self.buffers[key] = StaticBuffers(key, self.device, self.scratch_slot)
        index, tokens = buffers.write(batch, self.model.max_model_len)
        if from_device is not None:
            at, values = from_device
            buffers.token_ids[torch.from_numpy(tokens[at]).to(self.device, non_blocking=True)] = values
        if self.capture:
            graph, output, features = self.graphs.get(key) or self._capture(key, buffers, batch)
            graph.replay()
            self.replays += 1
        else:
            output = self._forward(buffers)
            features = self.model.captured
            self.eager_runs += 1
        if self.features is not None:  # the real tokens' features, in the batch's order
            assert features is not None
            self.model.captured = features[torch.from_numpy(tokens).to(self.device, non_blocking=True)]
        return output[torch.from_numpy(index).to(self.device, non_blocking=True)]

    def _forward(self, buffers: StaticBuffers) -> torch.Tensor:
        return padded_forward(self.model, self.kv, buffers, self.features)

    def _capture(
        self, key: GraphKey, buffers: StaticBuffers, batch: ForwardBatch
    ) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
        """Capture ``key``'s graph on padding only (warm-up and capture write the scratch slot),
        then lay the step out again."""
        buffers.fill_padding()
        outputs: list[torch.Tensor] = []
        graph = capture_graph(self.device, self._pool, lambda: outputs.append(self._forward(buffers)))
        output = outputs[-1]  # (the captured run's)
        features = self.model.captured if self.features is not None else None
        self.graphs[key] = (graph, output, features)
        logger.info("captured a CUDA graph for %s (%d graphs)", key, len(self.graphs))
        buffers.write(batch, self.model.max_model_len)
        return graph, output, features
