"""The cuda_ext C library: the draft channel between two real processes (round trips, a
missing, late or stale mask, a killed peer), the C host stream's ordering and trampolines, and
the CUDA source compiled by nvcc (no GPU needed)."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import torch

from guidespec import cuda_ext
from guidespec.cuda_ext.channel import (
    BAD_CHANNEL,
    DONE,
    PEER_GONE,
    STALE,
    TIMEOUT,
    TOO_LARGE,
    VERIFY,
    ChannelLayout,
    DraftChannel,
    DraftChannelError,
    StreamExchange,
)

pytestmark = pytest.mark.skipif(cuda_ext.library() is None, reason="no C compiler: the host library is not built")
WORDS = 5


def _spec(rows: int = 4, tokens: int = 64, spin_us: int = 0) -> ChannelLayout:
    return ChannelLayout(f"gs-test-{uuid.uuid4().hex[:8]}", rows, tokens, WORDS, spin_us)


def _mask_for(index: int, sequences: list[list[int]]) -> np.ndarray:
    """What the fake scheduler answers: row i holds the sum of its sequence, plus the draft index."""
    return np.array([[sum(s) + index] * WORDS for s in sequences], dtype=np.int32)


def _scheduler(spec: ChannelLayout, step: int, answer_step: int, steps: int, ready: mp.Event) -> None:
    """A scheduler process: answers draft steps of ``step`` (as ``answer_step``) until DONE."""
    channel = DraftChannel.attach(spec)
    ready.set()
    last = -1
    for _ in range(steps + 1):
        got = channel.next_drafts(step, last, 30.0, os.getppid())
        assert got is not None
        index, _, sequences = got
        if index == DONE:
            break
        channel.answer(answer_step, index, _mask_for(index, sequences))
        last = index
    channel.close()


def _start(target, *args) -> mp.Process:  # type: ignore[no-untyped-def]
    ready = mp.get_context("spawn").Event()
    process = mp.get_context("spawn").Process(target=target, args=(*args, ready), daemon=True)
    process.start()
    assert ready.wait(60)
    return process


@pytest.mark.parametrize("through,spin_us", [("direct", 0), ("host stream", 0), ("direct", 2000)])
def test_round_trips_with_a_scheduler_process(through: str, spin_us: int) -> None:
    spec = _spec(spin_us=spin_us)  # spinning (as beside a GPU) changes how a side waits, not what it gets
    channel = DraftChannel.create(spec)
    try:
        peer = _start(_scheduler, spec, 11, 11, 3)
        exchange = StreamExchange(channel, 30.0, peer.pid) if through == "host stream" else None
        for index, sequences in enumerate([[[1, 2], [3]], [[4], [5, 6], [7]], [[8, 9, 10]]]):
            rows = np.arange(len(sequences), dtype=np.int32)
            if exchange is not None:
                mask = exchange.exchange(11, index, rows, sequences)
            else:
                mask = channel.exchange(11, index, rows, sequences, 30.0, peer.pid)
            np.testing.assert_array_equal(mask, _mask_for(index, sequences))
        channel.done(11)
        peer.join(30)
        assert peer.exitcode == 0 and channel.last_error()[0] == 0
        if exchange is not None:
            exchange.close()
    finally:
        channel.close()


@pytest.mark.parametrize("spin_us", [0, 20_000])
def test_a_missing_mask_forbids_everything_and_says_so(spin_us: int) -> None:
    channel = DraftChannel.create(_spec(spin_us=spin_us))  # a spin longer than the deadline still ends there
    try:
        out = np.full((2, WORDS), -1, dtype=np.int32)
        code = channel.lib.gs_publish_drafts(
            channel.base,
            3,
            0,
            np.array([0, 1], np.int32).ctypes.data,
            2,
            np.array([1, 1], np.int32).ctypes.data,
            np.array([5, 6], np.int32).ctypes.data,
            2,
        )
        assert code == 0
        start = time.monotonic()
        code = channel.lib.gs_wait_mask(channel.base, 3, 0, 50_000, 0, out.ctypes.data, 2)
        assert code == TIMEOUT and 0.04 < time.monotonic() - start < 2.0
        assert not out.any()  # zeroed: every token forbidden, so no draft is accepted
        assert channel.last_error() == (TIMEOUT, 3, 0)
        with pytest.raises(DraftChannelError, match="step 3, draft 1: waiting for the scheduler's mask: no answer"):
            channel.exchange(3, 1, np.array([0]), [[1]], 0.05, 0)
    finally:
        channel.close()


def test_a_mask_of_another_step_is_stale_and_never_used() -> None:
    spec = _spec()
    channel = DraftChannel.create(spec)
    try:
        peer = _start(_scheduler, spec, 20, 21, 1)  # answers step 20's drafts as if they were step 21's
        start = time.monotonic()
        with pytest.raises(DraftChannelError) as failure:
            channel.exchange(20, 0, np.array([0]), [[1, 2]], 30.0, peer.pid)
        assert failure.value.code == STALE and time.monotonic() - start < 5.0
        assert channel.last_error() == (STALE, 20, 0)
        assert not channel._out[:1].any()
        channel.done(20)
        peer.join(30)
    finally:
        channel.close()


def _silent(spec: ChannelLayout, ready: mp.Event) -> None:
    channel = DraftChannel.attach(spec)
    ready.set()
    time.sleep(120)
    channel.close()


def test_a_killed_scheduler_ends_the_wait_at_once() -> None:
    spec = _spec()
    channel = DraftChannel.create(spec)
    try:
        peer = _start(_silent, spec)
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
        start = time.monotonic()
        with pytest.raises(DraftChannelError) as failure:
            channel.exchange(5, 0, np.array([0]), [[1]], 30.0, peer.pid)
        assert failure.value.code == PEER_GONE and time.monotonic() - start < 1.0
        # and the scheduler's side: a dead rank 0 ends its wait too
        with pytest.raises(DraftChannelError) as failure:
            channel.next_drafts(6, -1, 30.0, peer.pid)
        assert failure.value.code == PEER_GONE
    finally:
        channel.close()


def test_limits_and_layouts() -> None:
    spec = _spec(rows=2, tokens=4)
    channel = DraftChannel.create(spec)
    try:
        with pytest.raises(DraftChannelError) as failure:
            channel.exchange(1, 0, np.array([0, 1, 2]), [[1], [2], [3]], 1.0, 0)
        assert failure.value.code == TOO_LARGE
        with pytest.raises(DraftChannelError) as failure:
            channel.exchange(1, 0, np.array([0]), [[1, 2, 3, 4, 5]], 1.0, 0)
        assert failure.value.code == TOO_LARGE
        with pytest.raises(RuntimeError, match="not a draft channel of this layout"):
            DraftChannel.attach(ChannelLayout(spec.name, 3, 4, WORDS))
        assert channel.lib.gs_channel_check(channel.base, 2, 4, WORDS) == 0
        assert channel.lib.gs_channel_check(channel.base, 2, 4, WORDS + 1) == BAD_CHANNEL
    finally:
        channel.close()


class _VerifyWait:
    """A fused step's verify-mask wait (``gs_cb_verify_wait``) on 8 graph rows, logits row i at
    graph row ``PADDED_OF[i]``, called as the CPU's stream order calls it."""

    PADDED_OF = [0, 1, 2, 4, 5, 6]

    def __init__(self, channel: DraftChannel, step: int, timeout_s: float = 0.05, peer_pid: int = 0) -> None:
        from guidespec.cuda_ext.host_functions import HostFunctions, VerifyWaitArgs

        self.step = np.array([step], np.int64)
        self.padded_of = np.array(self.PADDED_OF, np.int32)
        self.enabled = np.ones(1, np.int32)
        self.out = np.full((8, WORDS), 7, np.int32)
        self.status = np.full(1, -1, np.int32)
        self.times = np.zeros(2, np.int64)
        address = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731
        self.args = VerifyWaitArgs(
            channel.base,
            address(self.step),
            int(timeout_s * 1e6),
            peer_pid,
            8,
            WORDS,
            len(self.padded_of),
            address(self.padded_of),
            address(self.enabled),
            address(self.out),
            address(self.status),
            address(self.times),
        )
        self.functions = HostFunctions(torch.device("cpu"))

    def __call__(self) -> int:
        self.functions.enqueue("gs_cb_verify_wait", self.args)
        return int(self.status[0])


def test_verify_masks_land_at_their_graph_rows_and_come_before_draft_zero() -> None:
    channel = DraftChannel.create(_spec(rows=8))
    try:
        masks = np.array([[11] * WORDS, [44] * WORDS], np.int32)
        assert channel.answer_verify(7, np.array([1, 4]), masks)
        wait = _VerifyWait(channel, 7)
        assert wait() == 0
        expected = np.full((8, WORDS), -1, np.int32)  # unguided rows: every token allowed
        expected[1], expected[5] = masks  # logits rows 1 and 4 sit at graph rows 1 and 5
        np.testing.assert_array_equal(wait.out, expected)
        # the step's verify tag is older than its draft 0's: a draft-0 wait goes on waiting
        with pytest.raises(DraftChannelError) as failure:
            channel.exchange(7, 0, np.array([0]), [[1]], 0.05, 0)
        assert failure.value.code == TIMEOUT
        assert not channel.answer_verify(8, np.arange(9), np.zeros((9, WORDS), np.int32))  # more than it holds
    finally:
        channel.close()


def test_a_missing_stale_or_misplaced_verify_mask_forbids_every_row() -> None:
    channel = DraftChannel.create(_spec(rows=8))
    try:
        wait = _VerifyWait(channel, 3)
        start, wall = time.monotonic(), time.time()
        assert wait() == TIMEOUT and 0.04 < time.monotonic() - start < 2.0
        began, ended = wait.times / 1e9  # (the trampoline times its wait, on time.time()'s clock)
        assert wall - 0.01 <= began and 0.04 < ended - began < 2.0 and ended <= time.time() + 0.01
        assert not wait.out.any() and channel.last_error() == (TIMEOUT, 3, VERIFY)
        channel.answer_verify(4, np.array([0]), np.ones((1, WORDS), np.int32))  # the next step's
        assert wait() == STALE and not wait.out.any()
        wait.step[0] = 4
        channel.answer_verify(4, np.array([6]), np.ones((1, WORDS), np.int32))  # a row the graph lacks
        assert wait() == STALE and not wait.out.any()
        wait.enabled[0] = 0  # a warm-up on padding waits for nothing and allows everything
        assert wait() == 0 and (wait.out == -1).all()
    finally:
        channel.close()


def test_a_killed_scheduler_ends_the_verify_wait_at_once() -> None:
    spec = _spec(rows=8)
    channel = DraftChannel.create(spec)
    try:
        peer = _start(_silent, spec)
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
        wait = _VerifyWait(channel, 9, timeout_s=30.0, peer_pid=peer.pid)
        start = time.monotonic()
        assert wait() == PEER_GONE and time.monotonic() - start < 1.0
        assert not wait.out.any()
    finally:
        channel.close()


def test_the_host_stream_runs_host_functions_in_order() -> None:
    lib = cuda_ext.library()
    assert lib is not None
    seen: list[int] = []
    callback_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

    @callback_type
    def record(arg: int | None) -> None:  # (a test's callback may be Python; ours never are)
        time.sleep(0.001 if (arg or 0) % 3 == 0 else 0)
        seen.append(arg or 0)

    stream = lib.gs_host_stream_create(4)  # fewer slots than tasks: enqueue waits for room
    try:
        for i in range(1, 41):
            lib.gs_host_stream_enqueue(stream, ctypes.cast(record, ctypes.c_void_p), ctypes.c_void_p(i))
        lib.gs_host_stream_synchronize(stream)
        assert seen == list(range(1, 41))
    finally:
        lib.gs_host_stream_destroy(stream)


@pytest.mark.skipif(cuda_ext.nvcc() is None, reason="no nvcc on this machine")
def test_the_cuda_source_compiles_with_nvcc(tmp_path: Path) -> None:
    result = cuda_ext.compile_cuda(tmp_path / "host_callbacks.o")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "host_callbacks.o").stat().st_size > 0
