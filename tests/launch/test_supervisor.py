"""The engine's supervision: a dying engine process fails the requests in flight with a clear
error, and a restarting LLM serves again from fresh processes (``guidespec.launch.supervisor``)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from guidespec import LLM, EngineDeadError, SamplingParams
from tests.conftest import leftovers

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)


def test_killed_worker_fails_requests_with_a_clear_error_within_2s() -> None:
    engine = LLM(max_batch_size=4, show_progress=False)
    try:
        worker = engine._processes.processes["worker rank 0"]
        stream = engine.stream("Tell me a long story.", SamplingParams(max_tokens=5000, ignore_eos=True))
        next(stream)
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"worker rank 0 .*(killed|died)"):
            for _ in stream:
                pass
        assert time.monotonic() - start < 2.0
        with pytest.raises(EngineDeadError, match="worker rank 0"):
            engine.generate("Hi", GREEDY)
        assert not engine.is_healthy and engine.num_restarts == 0  # restart_on_failure is off by default
    finally:
        engine.close()


def test_a_restarting_llm_serves_again_after_its_scheduler_dies() -> None:
    engine = LLM(max_batch_size=2, show_progress=False, restart_on_failure=True)
    try:
        expected = engine.generate("Hi", GREEDY)[0].token_ids
        old = engine._processes
        pids = [p.pid for p in old.processes.values()]
        names = [f"/dev/shm/{old.ring.layout.name}", f"/dev/shm/{old.arena.layout.name}"] + [
            e.removeprefix("ipc://") for e in vars(old.endpoints).values()
        ]
        stream = engine.stream("Tell me a long story.", SamplingParams(max_tokens=5000, ignore_eos=True))
        next(stream)
        os.kill(old.processes["scheduler"].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="scheduler .*killed.*restarting"):
            for _ in stream:
                pass
        deadline = time.monotonic() + 60
        while not engine.is_healthy:
            assert time.monotonic() < deadline, "no fresh engine within 60 s"
            time.sleep(0.1)
        assert engine.num_restarts == 1 and engine._processes is not old
        assert engine.generate("Hi", GREEDY)[0].token_ids == expected
        assert leftovers(names, pids) == ([], [])
    finally:
        engine.close()
