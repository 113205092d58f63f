"""The zygote: engine processes forked from one pre-imported process per client."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from guidespec import LLM, SamplingParams
from guidespec.launch import zygote
from tests.conftest import parent_pid

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _name(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def test_engine_processes_come_from_a_zygote_of_their_environment(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GUIDESPEC_LOG_LEVEL", "WARNING")  # guidespec's own variables: the zygote still serves
    with LLM(max_batch_size=2, show_progress=False) as llm:
        forked = llm.generate("The capital of France is", GREEDY)[0].token_ids
        pids = [p.pid for p in llm._processes.processes.values()]
        (old,) = {parent_pid(pid) for pid in pids}
        assert _name(old) == "gs-zygote"
        # each writes where this process writes now (pytest's capture file), as an inherited fd would
        assert {os.readlink(f"/proc/{pid}/fd/2") for pid in pids} == {os.readlink("/proc/self/fd/2")}
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)  # reaped by the zygote
    # a variable the zygote's imports read (a native library's): a new zygote, the old one exits
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with LLM(max_batch_size=2, show_progress=False) as llm:
        assert llm.generate("The capital of France is", GREEDY)[0].token_ids == forked
        (new,) = {parent_pid(p.pid) for p in llm._processes.processes.values()}
        assert new != old and _name(new) == "gs-zygote"
        assert _gone(old, 10.0)
    monkeypatch.setenv("GUIDESPEC_ZYGOTE", "0")  # every process a new interpreter
    with LLM(max_batch_size=2, show_progress=False) as llm:
        assert llm.generate("The capital of France is", GREEDY)[0].token_ids == forked
        assert {parent_pid(p.pid) for p in llm._processes.processes.values()} == {os.getpid()}
    assert zygote._zygote is not None and zygote._zygote.process is not None
    assert zygote._zygote.process.pid == new
    capfd.readouterr()


def _gone(pid: int, timeout_s: float) -> bool:
    """Exited, and reaped by this process (not left a zombie)."""
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not Path(f"/proc/{pid}").exists()


def test_a_killed_client_takes_its_zygote_and_engine_with_it(tmp_path: Path) -> None:
    script = tmp_path / "client.py"
    script.write_text(
        textwrap.dedent("""
            import time
            from guidespec import LLM, SamplingParams
            from guidespec.launch import zygote

            llm = LLM(max_batch_size=1, show_progress=False)
            llm.generate("Hi", SamplingParams(max_tokens=2))
            pids = [zygote._zygote.process.pid] + [p.pid for p in llm._processes.processes.values()]
            print(*pids, flush=True)
            time.sleep(600)
        """)
    )
    client = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None
        pids = [int(p) for p in client.stdout.readline().split()]
        assert len(pids) == 3 and _name(pids[0]) == "gs-zygote"
        client.send_signal(signal.SIGKILL)  # no shutdown, no atexit: only the closed socket says it
        client.wait()
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in pids if Path(f"/proc/{p}").exists() and _state(p) != "Z"]
    finally:
        client.kill()
        client.wait()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_a_zygote_keeps_the_tokenizer_and_tables_of_a_model_it_started_a_scheduler_of(
    tiny_base_model: Path, tmp_path: Path
) -> None:
    """The zygote's preparation of a scheduler request (``zygote._prepare``, run here in this
    process): nothing for a model's first scheduler (its scheduler makes them beside the workers'
    loads), the model's tokenizer, both backends' tables and early closing's classes of its
    vocabulary made and kept for the next, so that
    a scheduler forked after has them (the same objects ``fork_compile_process`` then finds)."""
    from guidespec.config import SchedulerConfig, config_to_dict
    from guidespec.grammar_backends.llguidance_backend import LLGuidanceBackend
    from guidespec.grammar_backends.tables import _TABLES
    from guidespec.ipc.broadcast import BroadcastLayout
    from guidespec.model_files import _SHARED_TOKENIZERS, shared_tokenizer
    from guidespec.scheduler.grammar.closing_step import closing_tokens

    folder = Path(shutil.copytree(tiny_base_model, tmp_path / "model"))  # (a folder no other test loaded)
    config = SchedulerConfig(
        folder, 2, 64, 64, (256,), 1, BroadcastLayout(None), "ipc://a", "ipc://b", "ipc://c", 257,
        "auto", 10.0, "verified",
    )  # fmt: skip
    request = {"job": {"role": "scheduler", "config": config_to_dict(config)}}
    folder = folder.resolve()
    ours = lambda: [key for key in _SHARED_TOKENIZERS if key[0] == folder]  # noqa: E731
    assert ours() == []
    zygote._prepare(request)
    assert ours() == []  # (a first scheduler makes its own)
    zygote._prepare(request)
    tokenizer = shared_tokenizer(folder)
    # xgrammar's and llguidance's tables, early closing's classes
    assert ours() and sum(found[0] is tokenizer for found in _TABLES.values()) == 3
    assert closing_tokens(tokenizer, 257, (256,)) is closing_tokens(tokenizer, 257, (256,))
    # a scheduler's own preparation after finds them: the same llguidance tokenizer
    assert LLGuidanceBackend.tables(tokenizer, 257, (256,)) is LLGuidanceBackend.tables(tokenizer, 257, (256,))
    kept = len(_TABLES)
    zygote._prepare({"job": {"role": "worker", "config": {}}})  # (a worker's request: nothing made)
    assert len(_TABLES) == kept and len(ours()) == 1


_FORK = """
import gc, os
from guidespec.launch import zygote
kept = [[i] for i in range(50_000)]
pid = zygote._fork()
if pid == 0:
    os._exit(0 if gc.get_freeze_count() >= 50_000 and len(gc.get_objects()) < 1_000 else 1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), gc.get_freeze_count() >= 50_000)
"""


def test_a_fork_from_the_zygote_collects_only_what_the_child_made() -> None:
    """The zygote's objects are frozen before it forks: an engine process's collections (its
    start's, ``freeze_startup_objects``) walk none of them. In a process of its own: freezing is
    for life."""
    out = subprocess.run([sys.executable, "-c", _FORK], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "True"]


def test_the_llm_module_leaves_torch_to_the_engine_s_start() -> None:
    """``from guidespec import LLM`` imports no torch (1.5 s of the client's start): ``LLM()``
    imports it once its zygote has started (``zygote.warm_up_before_torch``), so the zygote's
    imports run beside it."""
    script = "import sys; from guidespec import LLM; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]
