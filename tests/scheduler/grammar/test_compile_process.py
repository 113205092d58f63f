"""The grammar compile process as background work: its own session (a scheduling group of its own
where the kernel groups by session), a raised nice value, and gone with the scheduler."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from guidespec import LLM, SamplingParams
from guidespec.protocol import GuidedDecoding
from tests.conftest import leftovers, parent_pid


def _compile_pid(scheduler_pid: int, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for comm in Path("/proc").glob("[0-9]*/comm"):
            try:
                pid = int(comm.parent.name)
                if comm.read_text().strip() == "gs-compile" and parent_pid(pid) == scheduler_pid:
                    return pid
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(0.05)
    raise AssertionError(f"no compile process under the scheduler {scheduler_pid}")


def _thread_nices(pid: int) -> dict[str, int]:
    """Each thread's nice value (field 19 of /proc/PID/task/TID/stat)."""
    out = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            out[stat.parent.name] = int(stat.read_text().rsplit(")", 1)[1].split()[16])
        except (OSError, IndexError, ValueError):
            continue
    return out


def test_the_compile_process_and_the_grammar_loader_run_below_serving(default_llm: LLM) -> None:
    guided = SamplingParams(max_tokens=4, guided=GuidedDecoding(choice=("alpha", "beta")))
    default_llm.generate("Pick:", guided)  # (the scheduler's grammar loader thread has started)
    scheduler = default_llm._engine.processes.processes["scheduler"].pid
    compiler = _compile_pid(scheduler)
    assert os.getsid(compiler) == compiler != os.getsid(scheduler)  # a session, so a group, of its own
    nices = _thread_nices(compiler)
    assert nices and min(nices.values()) >= 10, nices
    if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1":
        assert Path(f"/proc/{compiler}/autogroup").read_text().split()[-1] == "10"
    scheduler_nices = _thread_nices(scheduler)
    assert scheduler_nices[str(scheduler)] == 0  # the loop itself keeps its priority
    assert max(scheduler_nices.values()) == 10  # the loader thread (it compiles small grammars again)


def test_the_compile_process_dies_with_the_scheduler(tiny_base_model: Path) -> None:
    """Outside the scheduler's process group, ``kill_group`` no longer reaches it: it dies with
    the scheduler (``die_with_parent``)."""
    with LLM(str(tiny_base_model), max_batch_size=2, show_progress=False, restart_on_failure=False) as engine:
        scheduler = engine._engine.processes.processes["scheduler"].pid
        compiler = _compile_pid(scheduler)
        os.kill(scheduler, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while leftovers([], [compiler]) != ([], []):
            assert time.monotonic() < deadline, "the compile process outlived its scheduler"
            time.sleep(0.05)
