"""Applying token bitmasks to logits: bit j of word w set means token 32*w + j is allowed.

Only the rows named in ``rows`` are touched (rows of unguided requests are skipped): bitmask
row ``i`` applies to logits row ``rows[i]``. :func:`apply_bitmask` works on any device (torch
ops); on CUDA, :class:`DeviceMasks` copies the step's rows from the mask arena to the GPU
asynchronously and applies them with our Triton kernel (``kernels/bitmask_triton.py``).

A row whose mask allows exactly one token (the grammar forces it) needs no logits at all: its
masked distribution puts all mass on that token, whatever the model says. ``only_allowed``
finds those rows, so the workers skip their LM head (a fifth of a token's compute for this
model) and the mask, as jump-forward skips the whole step for them. A row whose mask allows
few tokens (a JSON grammar between values: punctuation, a key, a digit) needs only their
logits: the worker computes those alone where the model can (``allowed_counts``).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np
import torch

from guidespec.bitmask import allowed_counts
from guidespec.worker import kernels

logger = logging.getLogger(__name__)
_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab] bool (True = allowed), on ``bitmask``'s device."""
    bits = (bitmask[:, :, None] >> _BITS.to(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, rows: np.ndarray | torch.Tensor, bitmask: np.ndarray | torch.Tensor) -> None:
    """Set disallowed tokens of ``logits[rows]`` to -inf, in place (torch ops on logits' device)."""
    if len(rows) == 0:
        return
    on_host = isinstance(rows, np.ndarray) and isinstance(bitmask, np.ndarray)
    if on_host and kernels.apply_bitmask(logits, rows, bitmask):  # type: ignore[arg-type]
        return  # the CPU kernel (kernels/logits_ops.c)
    device = logits.device
    if isinstance(bitmask, np.ndarray):
        bitmask = torch.from_numpy(np.array(bitmask, dtype=np.int32))
    index = rows.to(device) if isinstance(rows, torch.Tensor) else torch.from_numpy(np.asarray(rows, dtype=np.int64))
    allowed = unpack_bitmask(bitmask.to(device, non_blocking=True), logits.shape[-1])
    index = index.to(device, non_blocking=True)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def only_allowed(
    rows: np.ndarray, bitmask: np.ndarray, num_rows: int, vocab_size: int, counts: np.ndarray | None = None
) -> np.ndarray:
    """[num_rows] int64: for each logits row, the one token its mask allows, or -1 (no mask,
    or any other number of tokens allowed). ``counts``: :func:`allowed_counts` of ``bitmask``,
    where the caller has them; without them the CPU kernel reads each row to its second allowed
    token (a count of every bit costs ~8,000 words a row at a 262k vocabulary)."""
    out = np.full(num_rows, -1, dtype=np.int64)
    if len(rows) == 0:
        return out
    tokens = kernels.single_tokens(np.asarray(bitmask), vocab_size) if counts is None else None
    if tokens is not None:
        out[np.asarray(rows)] = tokens
        return out
    words = np.asarray(bitmask).view(np.uint32)
    single = np.flatnonzero((allowed_counts(bitmask) if counts is None else counts) == 1)
    if len(single):
        nonzero = words[single] != 0
        word = np.argmax(nonzero, axis=1)
        bit = np.bitwise_count(words[single, word] - np.uint32(1))  # the one set bit's index
        token = 32 * word + bit.astype(np.int64)
        inside = token < vocab_size
        out[np.asarray(rows)[single[inside]]] = token[inside]
    return out


class DeviceMasks:
    """A step's bitmask rows on the model's device.

    On CUDA, the arena's pages are page-locked once (``cudaHostRegister``), so :meth:`upload`
    copies a step's rows host-to-device asynchronously on a side stream: the copy is enqueued as
    soon as the scheduler's second broadcast arrives, while the forward's kernels still run, and
    the main stream waits on it only where the mask is applied. Rows that come in a message (a
    remote rank's) are copied the same way from pageable memory. On the CPU nothing is copied:
    the arena's rows are used in place.

    Bookkeeping (which buffers are registered, the device buffer's shape) is the same on both, so
    the CPU tests run it.
    """

    def __init__(
        self, device: torch.device | str, max_rows: int, num_words: int, arena_buffers: list[np.ndarray] | None = None
    ) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.max_rows, self.num_words = max_rows, num_words
        self.registered: list[tuple[int, int]] = []  # (address, bytes) page-locked with CUDA
        self._stream: Any = None
        self._copied: Any = None  # the event the last upload recorded
        if self.cuda:
            self._stream = torch.cuda.Stream(device=self.device)
            for buffer in arena_buffers or []:
                self._register(buffer)
        # one device buffer of the arena's row capacity, written by uploads (CPU: unused)
        self.rows_on_device = torch.empty(
            max_rows if self.cuda else 0, num_words, dtype=torch.int32, device=self.device
        )

    def _register(self, buffer: np.ndarray) -> None:
        address, size = int(buffer.__array_interface__["data"][0]), int(buffer.nbytes)
        code = torch.cuda.cudart().cudaHostRegister(address, size, 0)
        if int(code) != 0:  # not fatal: the copy is then synchronous (as from any pageable memory)
            logger.warning("page-locking the mask arena failed (cudaError %s): its copies will not overlap", int(code))
            return
        self.registered.append((address, size))

    def is_pinned(self, bitmask: np.ndarray) -> bool:
        address = int(bitmask.__array_interface__["data"][0])
        return any(start <= address < start + size for start, size in self.registered)

    def upload(self, bitmask: np.ndarray) -> torch.Tensor:
        """``bitmask`` [R, W] on the device: on CUDA, an asynchronous copy on the side stream
        into the device buffer (the returned view is valid once :meth:`wait` ran on the stream
        that reads it); on the CPU, the rows themselves."""
        with warnings.catch_warnings():  # the arena's rows are read-only views; nothing writes them here
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            host = torch.from_numpy(np.asarray(bitmask))
        if not self.cuda:
            return host
        n = host.shape[0]
        if n > self.max_rows or host.shape[1] != self.num_words:  # (a step whose mask came through the ring)
            self._copied = None
            return host.to(self.device)
        # the main stream may still read the previous step's rows: the side stream waits for it
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            target = self.rows_on_device[:n]
            target.copy_(host, non_blocking=self.is_pinned(bitmask))
            self._copied = torch.cuda.Event()
            self._copied.record(self._stream)
        return target

    def wait(self) -> None:
        """Make the current stream wait for the last upload (no host wait)."""
        if self.cuda and self._copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied)

    def apply(self, logits: torch.Tensor, rows: np.ndarray, bitmask: np.ndarray) -> None:
        """Apply ``bitmask`` (bitmask row i to logits row ``rows[i]``), in place on the device."""
        if len(rows) == 0:
            return
        if not self.cuda:
            apply_bitmask(logits, rows, bitmask)
            return
        on_device = self.upload(bitmask)
        self.wait()
        apply_on_device(logits, rows, on_device)

    def close(self) -> None:
        for address, _ in self.registered:
            torch.cuda.cudart().cudaHostUnregister(address)
        self.registered = []


def apply_on_device(logits: torch.Tensor, rows: np.ndarray, bitmask: torch.Tensor) -> None:
    """Rows already on the device: our Triton kernel, which reads the row map as it is (unguided
    rows are not in it and cost nothing: ``kernels/bitmask_triton.py``); torch ops without Triton."""
    from guidespec.worker.kernels import bitmask_triton

    if not bitmask_triton.available():
        apply_bitmask(logits, rows, bitmask)
        return
    index = torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(logits.device, non_blocking=True)
    bitmask_triton.apply_rows(logits, index, bitmask.contiguous())
