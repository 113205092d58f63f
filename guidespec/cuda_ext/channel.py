"""The draft channel from Python: a shared-memory segment the launcher creates, rank 0 and the
scheduler map, and the C library (``draft_channel.c``) reads and writes. Python only lays out
numpy views and calls the C functions (ctypes drops the GIL while they wait).

Rank 0, each draft step: :meth:`DraftChannel.exchange` (publish the rows' token sequences, wait
for their mask rows). The scheduler, while a step's drafting lasts: :meth:`DraftChannel.next_drafts`
then :meth:`DraftChannel.answer`, until rank 0's :meth:`DraftChannel.done`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from guidespec.cuda_ext import library

OK, TIMEOUT, STALE, PEER_GONE, TOO_LARGE, BAD_CHANNEL = range(6)
DONE = -1
VERIFY = -2  # the draft index of a step's verify masks (layout/step_graph.py)
_WHAT = {
    TIMEOUT: "no answer before the deadline",
    STALE: "an answer for another step or draft",
    PEER_GONE: "the other process died",
    TOO_LARGE: "more rows or tokens than the channel holds",
    BAD_CHANNEL: "not a draft channel of this layout",
}


class DraftChannelError(RuntimeError):
    def __init__(self, code: int, step: int, draft_index: int, side: str) -> None:
        super().__init__(f"step {step}, draft {draft_index}: {side}: {_WHAT.get(code, f'error {code}')}")
        self.code, self.step, self.draft_index = code, step, draft_index


@dataclass(frozen=True)
class ChannelLayout:
    name: str
    max_rows: int  # rows a draft step can carry (the max batch size)
    max_tokens: int  # tokens of all rows' sequences together
    num_words: int  # int32 words per mask row: ceil(vocab / 32)
    spin_us: int = 0  # how long a waiter polls before it sleeps on the futex (after a few thousand polls)


def available() -> bool:
    return library() is not None


class DraftChannel:
    def __init__(self, shm: shared_memory.SharedMemory, layout: ChannelLayout, owner: bool) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError("the cuda_ext host library is not built (no C compiler)")
        self.lib, self.layout, self._shm, self._owner = lib, layout, shm, owner
        buf = shm.buf
        assert buf is not None
        self._anchor = ctypes.c_char.from_buffer(buf)  # the mapping stays exported while base is in use
        self.base = ctypes.c_void_p(ctypes.addressof(self._anchor))
        args = (layout.max_rows, layout.max_tokens, layout.num_words)
        if owner:
            lib.gs_channel_init(self.base, *args, layout.spin_us)
        elif lib.gs_channel_check(self.base, *args) != OK:
            raise RuntimeError(f"shared memory {layout.name!r} is not a draft channel of this layout")
        at = [lib.gs_channel_offset(self.base, i) for i in range(4)]
        self.rows = np.ndarray(layout.max_rows, np.int32, buf, at[0])
        self.lens = np.ndarray(layout.max_rows, np.int32, buf, at[1])
        self.tokens = np.ndarray(layout.max_tokens, np.int32, buf, at[2])
        self.mask = np.ndarray((layout.max_rows, layout.num_words), np.int32, buf, at[3])
        self.mask_ids = np.ndarray(layout.max_rows, np.int32, buf, lib.gs_channel_offset(self.base, 4))
        self._out = np.zeros((layout.max_rows, layout.num_words), np.int32)  # rank 0's copy of a mask
        self._i = [ctypes.c_int32() for _ in range(3)]

    @classmethod
    def create(cls, layout: ChannelLayout) -> DraftChannel:
        lib = library()
        if lib is None:
            raise RuntimeError("the cuda_ext host library is not built (no C compiler)")
        size = int(lib.gs_channel_bytes(layout.max_rows, layout.max_tokens, layout.num_words))
        from guidespec.ipc.segments import create_segment

        return cls(create_segment(layout.name, size), layout, owner=True)

    @classmethod
    def attach(cls, layout: ChannelLayout) -> DraftChannel:
        from guidespec.ipc.segments import attach_segment

        return cls(attach_segment(layout.name), layout, owner=False)

    # ------------------------------------------------------------------ rank 0

    def exchange(
        self, step: int, draft_index: int, rows: np.ndarray, sequences: list[list[int]], timeout_s: float, peer_pid: int
    ) -> np.ndarray:
        """Publish the rows' sequences, wait for their mask rows [len(rows), words] (a copy).
        DraftChannelError where no right mask came: the returned rows would be all zero."""
        self.publish(step, draft_index, rows, sequences)
        return self.wait(step, draft_index, len(rows), timeout_s, peer_pid)

    def publish(self, step: int, draft_index: int, rows: np.ndarray, sequences: list[list[int]]) -> None:
        """The first half of :meth:`exchange`: the scheduler starts filling these rows' masks."""
        rows = np.ascontiguousarray(rows, dtype=np.int32)
        lens = np.array([len(s) for s in sequences], dtype=np.int32)
        flat = np.array([t for s in sequences for t in s], dtype=np.int32)
        code = self.lib.gs_publish_drafts(
            self.base, step, draft_index, rows.ctypes.data, len(rows), lens.ctypes.data, flat.ctypes.data, len(flat)
        )
        if code != OK:
            raise DraftChannelError(code, step, draft_index, "publishing drafts")

    def wait(self, step: int, draft_index: int, n: int, timeout_s: float, peer_pid: int) -> np.ndarray:
        """The second half of :meth:`exchange`: the ``n`` published rows' masks (a copy)."""
        code = self.lib.gs_wait_mask(
            self.base, step, draft_index, int(timeout_s * 1e6), peer_pid, self._out.ctypes.data, n
        )
        if code != OK:
            raise DraftChannelError(code, step, draft_index, "waiting for the scheduler's mask")
        return self._out[:n].copy()

    def done(self, step: int) -> None:
        """No more drafts this step: the scheduler goes back to waiting for the step's outputs."""
        self.lib.gs_publish_done(self.base, step)

    # ------------------------------------------------------------------ the scheduler

    def next_drafts(
        self, step: int, last_index: int, timeout_s: float, peer_pid: int
    ) -> tuple[int, np.ndarray, list[list[int]]] | None:
        """The next draft step of ``step`` after ``last_index`` (-1: none yet): (draft index, rows,
        sequences), with index DONE when rank 0 is done; None on timeout. DraftChannelError for a
        dead rank 0 or a draft of a later step."""
        index, num_rows, num_tokens = self._i
        code = self.lib.gs_wait_drafts(
            self.base,
            step,
            last_index,
            int(timeout_s * 1e6),
            peer_pid,
            ctypes.byref(index),
            ctypes.byref(num_rows),
            ctypes.byref(num_tokens),
        )
        if code == TIMEOUT:
            return None
        if code != OK:
            raise DraftChannelError(code, step, last_index + 1, "waiting for rank 0's drafts")
        n = num_rows.value
        lens = self.lens[:n].tolist()
        flat = self.tokens[: num_tokens.value].tolist()
        sequences, at = [], 0
        for length in lens:
            sequences.append(flat[at : at + length])
            at += length
        return index.value, self.rows[:n].copy(), sequences

    def answer(self, step: int, draft_index: int, bitmask: np.ndarray) -> None:
        n = bitmask.shape[0]
        self.mask[:n] = bitmask
        code = self.lib.gs_publish_mask(self.base, step, draft_index, n)
        if code != OK:
            raise DraftChannelError(code, step, draft_index, "publishing a mask")

    def answer_verify(self, step: int, ids: np.ndarray, bitmask: np.ndarray) -> bool:
        """The step's verify masks for a fused step (layout/step_graph.py): row i for logits row
        ``ids[i]``. False where they do not fit the channel (rank 0 then runs the step unfused)."""
        n = len(ids)
        if n > self.layout.max_rows:
            return False
        self.mask[:n] = bitmask
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        code = self.lib.gs_publish_verify_mask(self.base, step, ids.ctypes.data, n)
        if code != OK:
            raise DraftChannelError(code, step, VERIFY, "publishing verify masks")
        return True

    # ------------------------------------------------------------------ both

    def last_error(self) -> tuple[int, int, int]:
        """(code, step, draft index) of the last failed wait; code 0 when none."""
        step, index = ctypes.c_int64(), ctypes.c_int32()
        code = self.lib.gs_last_error(self.base, ctypes.byref(step), ctypes.byref(index))
        return int(code), step.value, index.value

    def close(self) -> None:
        from guidespec.ipc.segments import close_segment

        self.rows = self.lens = self.tokens = self.mask = self.mask_ids = None  # type: ignore[assignment]
        del self._anchor
        close_segment(self._shm, self._owner)


class _PublishArgs(ctypes.Structure):
    _fields_ = [
        ("channel", ctypes.c_void_p),
        ("step", ctypes.c_void_p),
        ("draft_index", ctypes.c_int32),
        ("rows", ctypes.c_void_p),
        ("lens", ctypes.c_void_p),
        ("tokens", ctypes.c_void_p),
        ("num_rows", ctypes.c_void_p),
        ("num_tokens", ctypes.c_void_p),
        ("status", ctypes.c_void_p),
    ]


class _WaitArgs(ctypes.Structure):
    _fields_ = [
        ("channel", ctypes.c_void_p),
        ("step", ctypes.c_void_p),
        ("draft_index", ctypes.c_int32),
        ("timeout_us", ctypes.c_int64),
        ("peer_pid", ctypes.c_int32),
        ("out", ctypes.c_void_p),
        ("num_rows", ctypes.c_void_p),
        ("status", ctypes.c_void_p),
    ]


class StreamExchange:
    """Rank 0's exchange through the C host stream: per draft index, one publish and one wait
    argument block made once (as a captured graph holds them) whose pointers lead to buffers
    this object keeps; each exchange writes this step's values into the buffers, enqueues the
    two trampolines (``gs_cb_publish_drafts``, ``gs_cb_wait_mask``), waits for the stream, and
    reads the statuses the callbacks left. What a CUDA stream replays, run on a CPU thread."""

    def __init__(self, channel: DraftChannel, timeout_s: float, peer_pid: int, max_draft_steps: int = 32) -> None:
        lib, layout = channel.lib, channel.layout
        self.channel, self.lib = channel, lib
        self.stream = lib.gs_host_stream_create(8)
        if not self.stream:
            raise RuntimeError("could not start the host stream")
        self.step = np.zeros(1, np.int64)
        self.counts = np.zeros(2, np.int32)  # rows, tokens
        self.status = np.zeros(2, np.int32)  # publish, wait
        self.rows = np.zeros(layout.max_rows, np.int32)
        self.lens = np.zeros(layout.max_rows, np.int32)
        self.tokens = np.zeros(layout.max_tokens, np.int32)
        self.out = np.zeros((layout.max_rows, layout.num_words), np.int32)
        c = lambda a, offset=0: ctypes.c_void_p(a.ctypes.data + offset)  # noqa: E731
        self.publish = [
            _PublishArgs(
                channel.base,
                c(self.step),
                j,
                c(self.rows),
                c(self.lens),
                c(self.tokens),
                c(self.counts),
                c(self.counts, 4),
                c(self.status),
            )
            for j in range(max_draft_steps)
        ]
        self.wait = [
            _WaitArgs(
                channel.base,
                c(self.step),
                j,
                int(timeout_s * 1e6),
                peer_pid,
                c(self.out),
                c(self.counts),
                c(self.status, 4),
            )
            for j in range(max_draft_steps)
        ]
        self._publish_fn = ctypes.cast(lib.gs_cb_publish_drafts, ctypes.c_void_p)
        self._wait_fn = ctypes.cast(lib.gs_cb_wait_mask, ctypes.c_void_p)

    def exchange(self, step: int, draft_index: int, rows: np.ndarray, sequences: list[list[int]]) -> np.ndarray:
        self.post(step, draft_index, rows, sequences)
        return self.take(step, draft_index)

    def post(self, step: int, draft_index: int, rows: np.ndarray, sequences: list[list[int]]) -> None:
        """Enqueue the publish trampoline (it runs while the caller goes on, as on a GPU stream)."""
        if draft_index >= len(self.publish):
            raise DraftChannelError(TOO_LARGE, step, draft_index, "enqueueing a draft step")
        flat = [t for s in sequences for t in s]
        n, m = len(rows), len(flat)
        if n > len(self.rows) or m > len(self.tokens):
            raise DraftChannelError(TOO_LARGE, step, draft_index, "enqueueing a draft step")
        self.lib.gs_host_stream_synchronize(self.stream)  # (the buffers are free once the stream is idle)
        self.step[0], self.counts[:] = step, (n, m)
        self.rows[:n], self.lens[:n], self.tokens[:m] = rows, [len(s) for s in sequences], flat
        self.status[:] = -1
        self.lib.gs_host_stream_enqueue(self.stream, self._publish_fn, ctypes.byref(self.publish[draft_index]))

    def take(self, step: int, draft_index: int) -> np.ndarray:
        """Enqueue the wait trampoline after the publish, wait for the stream, and read the statuses."""
        self.lib.gs_host_stream_enqueue(self.stream, self._wait_fn, ctypes.byref(self.wait[draft_index]))
        self.lib.gs_host_stream_synchronize(self.stream)  # (a GPU stream would go on to the mask's copy)
        for code, side in zip(self.status.tolist(), ("publishing drafts", "waiting for the scheduler's mask")):
            if code != OK:
                raise DraftChannelError(code, step, draft_index, side)
        return self.out[: int(self.counts[0])].copy()

    def close(self) -> None:
        if self.stream:
            self.lib.gs_host_stream_destroy(self.stream)
            self.stream = None
