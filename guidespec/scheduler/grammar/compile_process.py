"""The compile process from the scheduler's side: starting it (forked from the scheduler's
process, or as a new interpreter for a restart), writing its settings line and jobs, and reading
its JSON-line answers on a thread of its own (``CompileClient``). What a job is, its deadline and
what its answer means are ``compiling.py``'s; the process itself is ``compile_worker.py``."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import IO, Any

from guidespec.grammar_backends import import_backends, prepare_tables
from guidespec.model_files import import_tokenizers, shared_tokenizer
from guidespec.protocol import GuidedDecoding, backend_order
from guidespec.scheduler.grammar.settings import GrammarSettings


class CompileClient:
    """The compile subprocess and a thread reading its JSON-line answers into a queue."""

    def __init__(self, settings: GrammarSettings, proc: CompileProcess | None = None) -> None:
        self.settings = settings
        self.answers: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.generation = 0
        self.started = threading.Event()  # the first process said "ready" (or exited)
        self._start(proc)

    def send(self, job_id: int, backend: str, guided: GuidedDecoding) -> None:
        line = json.dumps({"job": job_id, "backend": backend, "guided": dataclasses.asdict(guided)})
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the reader thread reports the exit; the job is sent again after the restart

    def drain(self) -> list[dict[str, Any]]:
        """Answers of the current process so far (answers of a killed one are dropped)."""
        out: list[dict[str, Any]] = []
        while True:
            try:
                generation, message = self.answers.get_nowait()
            except queue.Empty:
                return out
            if generation == self.generation:
                out.append(message)

    def restart(self) -> None:
        self.close()
        self.generation += 1
        self._start()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=5)

    def _start(self, proc: CompileProcess | None = None) -> None:
        self.proc = proc or start_compile_process(self.settings)  # a restart: its own imports (threads run here)
        threading.Thread(
            target=self._read, args=(self.proc, self.generation), daemon=True, name="guidespec-compile-reader"
        ).start()

    def _read(self, proc: CompileProcess, generation: int) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            message = json.loads(line)
            if message.get("ready"):
                self.started.set()
            else:
                self.answers.put((generation, message))
        self.started.set()
        self.answers.put((generation, {"exited": True}))


class ForkedCompileProcess:
    """The compile process forked from the scheduler's, as much of a ``Popen`` as
    ``CompileClient`` uses: its JSON lines through two pipes."""

    def __init__(self, pid: int, stdin: IO[str], stdout: IO[str]) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"compile process {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]


CompileProcess = subprocess.Popen[str] | ForkedCompileProcess


def prepare_grammar_tables(settings: GrammarSettings) -> None:
    """The tokenizer and the backends' tables of it, made and kept in this process (where they
    are already, nothing): the scheduler makes them before it forks its compile process, once for
    both (each made its own beside the other's: ~1 s of CPU twice on the same cores at every
    engine's start); the zygote, for a model it has started a scheduler of before, before it forks
    the next one (``launch/zygote.py``)."""
    import_backends(backend_order(settings.default_backend))
    import_tokenizers()
    prepare_tables(
        backend_order(settings.default_backend),
        shared_tokenizer(settings.model_dir),
        settings.vocab_size,
        tuple(settings.stop_token_ids),
    )


def fork_compile_process(settings: GrammarSettings) -> ForkedCompileProcess:
    """The compile process, forked from this one: the scheduler's process calls it once its
    imports (torch, xgrammar, transformers: ~3 s of CPU) are done and before it starts a thread,
    so the compile process has them for nothing (spawned, it ran them again beside the
    scheduler's and the worker's on the same cores: ~1.5 s of each engine start on 2 cores)."""
    prepare_grammar_tables(settings)
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()  # (read end, write end) pairs: child reads to_child's read end
    pid = os.fork()
    if pid == 0:  # the compile process: its ends on stdin and stdout, never back into the caller
        code = 1
        try:
            os.dup2(to_child, 0)
            os.dup2(from_child, 1)
            for fd in (to_child, from_parent, to_parent, from_child):
                os.close(fd)
            sys.stdin = open(0, encoding="utf-8", closefd=False)
            sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)
            from guidespec.process_utils import setup_child_process
            from guidespec.scheduler.grammar import compile_worker

            setup_child_process("compile")
            compile_worker.main()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            os._exit(code)
    os.close(to_child)
    os.close(from_child)
    proc = ForkedCompileProcess(
        pid, open(from_parent, "w", encoding="utf-8", buffering=1), open(to_parent, encoding="utf-8")
    )
    _write_settings(proc.stdin, settings)
    return proc


def start_compile_process(settings: GrammarSettings) -> subprocess.Popen[str]:
    """The compile process (``compile_worker.py``) as a new interpreter, its settings line written."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "guidespec.scheduler.grammar.compile_worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    assert proc.stdin is not None
    _write_settings(proc.stdin, settings)
    return proc


def _write_settings(stdin: IO[str], settings: GrammarSettings) -> None:
    fields = {
        "model_dir": str(settings.model_dir),
        "default_backend": settings.default_backend,
        "vocab_size": settings.vocab_size,
        "stop_token_ids": list(settings.stop_token_ids),
        "num_threads": settings.num_threads,
        "recompile": settings.recompile,
        "store_dir": settings.store_dir,
        "compile_timeout_s": settings.compile_timeout_s,
    }
    stdin.write(json.dumps(fields) + "\n")
    stdin.flush()
