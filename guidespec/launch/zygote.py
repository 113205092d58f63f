"""The zygote: one process per client that has imported what every engine process needs
(torch, xgrammar, transformers, the model and scheduler code: ~3-4 s of CPU) and forks the
engine's processes from there, so an engine starts without paying for those imports again.

    client --spawn(job, cwd, env, stdout+stderr fds)--> zygote --fork--> engine process
    client <--pid, exit code-- zygote

Messages are JSON over a ``SOCK_SEQPACKET`` socket pair (nothing is pickled); the client's
stdout and stderr travel with each request (``SCM_RIGHTS``), so an engine process writes where
a freshly started one would. The zygote never runs a torch operation or starts a thread: a
fork from it is as clean as a new interpreter. It reaps its children and reports their exit
codes. It dies with the client (a parent-death signal, tied to the client's thread that
listens to it for the client's whole life) and kills what it forked when the client's end of
the socket closes.

An engine process takes the client's environment of the moment. What the zygote's imports read
from it is fixed at the zygote's start: the variables they looked up through ``os.environ``
(recorded) and those native libraries read as they load (``PYTHON*``, ``LD_*``, OpenMP, BLAS,
``TORCH*``, ``CUDA_*``). Where one of those changed since, a new zygote starts and the old one
exits once its engines have. Where the zygote fails, for a CUDA engine by default, or with
``GUIDESPEC_ZYGOTE=0`` (``envs.zygote``), the engine's processes start as new interpreters
(``python -m guidespec.launch.child``).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from typing import Any

from guidespec import envs
from guidespec.process_utils import die_with_parent, kill_group, set_process_name

logger = logging.getLogger(__name__)
_MAX_MESSAGE = 1 << 20
_READY_TIMEOUT_S = 300.0  # the zygote's imports, on a loaded 2-core machine
_REPLY_TIMEOUT_S = 30.0
# read by native code as a library loads (the interpreter, the C library, OpenMP, BLAS, torch);
# PYTHONBREAKPOINT is read by each breakpoint() (Ray sets it in its driver's environment)
_NATIVE_PREFIXES = (
    "PYTHON",
    "LD_",
    "MALLOC_",
    "GLIBC_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH",
    "CUDA_",
)
_READ_WHEN_USED = ("PYTHONBREAKPOINT",)


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if len(data) > _MAX_MESSAGE:
        raise ValueError(f"a zygote message of {len(data)} bytes")
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


# ---- the zygote process ------------------------------------------------------------------


class _ReadsRecorded(os._Environ):  # type: ignore[type-arg]
    """``os.environ`` that records the names looked up (``os.getenv`` goes through it)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return super().__getitem__(key)

    def items(self) -> Any:  # a scan (tqdm's import looks for TQDM_* this way) names no variable
        return {self.decodekey(k): self.decodevalue(v) for k, v in self._data.items()}.items()  # type: ignore[attr-defined]


# torch.cuda.is_available() asks NVML rather than the CUDA runtime with this set: it then starts
# no CUDA driver and leaves forks usable (xgrammar's tvm_ffi calls it as it is imported)
_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _preload() -> list[str]:
    """Import everything an engine process imports on its way to ready, without running any of
    it; the environment variables those imports read."""
    environ: Any = os.environ
    added = _NVML_CHECK not in environ
    if added:
        environ[_NVML_CHECK] = "1"
    recorded = _ReadsRecorded(
        environ._data, environ.encodekey, environ.decodekey, environ.encodevalue, environ.decodevalue
    )
    os.environ = recorded
    try:
        _import_engine()
    finally:
        os.environ = environ
        if added:
            del environ[_NVML_CHECK]
            recorded.read.discard(_NVML_CHECK)
    return sorted(recorded.read)


def _forks_can_start_cuda() -> bool:
    """Whether a fork of this process can start CUDA: torch refuses in a child once the parent
    has asked the CUDA runtime anything (``torch.cuda.device_count()`` without NVML, say), so
    a fork tells."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda._is_compiled():
        return True
    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _import_engine() -> None:
    import guidespec.launch.child  # noqa: F401
    import guidespec.scheduler.scheduler  # noqa: F401
    import guidespec.worker.worker  # noqa: F401
    from guidespec.grammar_backends import import_backends
    from guidespec.model_files import import_tokenizers

    import_backends(["xgrammar", "llguidance"])
    import_tokenizers()


def main() -> None:
    """``python -m guidespec.launch.zygote FD CLIENT_PID``: serve spawn requests on socket FD
    until it closes; die with the client."""
    sock, client_pid = socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client shuts engines down, then closes the socket
    set_process_name("zygote")
    die_with_parent()
    if os.getppid() != client_pid:
        return  # the client died before the line above
    try:
        read = _preload()
        gc.collect()  # (its imports' garbage; what is left is frozen before each fork: ``_serve``)
        if not _forks_can_start_cuda():
            raise RuntimeError("its imports started the CUDA runtime: a fork could not use CUDA")
        # Python threads; native ones are OpenBLAS's pool (numpy), which stops itself around a fork
        _send(sock, {"ready": os.getpid(), "threads": threading.active_count(), "read": read})
    except BaseException as e:
        _send(sock, {"error": f"{type(e).__name__}: {e}"})
        raise
    children: dict[int, int] = {}  # pidfd -> pid
    try:
        _serve(sock, children)
    except OSError:
        pass  # the client's end closed under a write
    finally:  # the client is gone: so is every engine it started here
        for pid in children.values():
            kill_group(pid)


def _serve(sock: socket.socket, children: dict[int, int]) -> None:
    while True:
        readable, _, _ = select.select([sock.fileno(), *children], [], [])
        for pidfd in readable:
            if pidfd in children:
                pid = children.pop(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if sock.fileno() not in readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
        if not data:
            return
        request = json.loads(data)
        _prepare(request)
        pid = _fork()
        if pid == 0:
            sock.close()
            for pidfd in children:
                os.close(pidfd)
            _run_child(request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        children[os.pidfd_open(pid)] = pid
        _send(sock, {"pid": pid})


def _fork() -> int:
    """``os.fork()``, this process's objects frozen first (``gc.freeze``: the imports' and the tables
    kept), as Python's documentation advises before a fork: the child's collections, its start's
    among them (``freeze_startup_objects``), walk only what it made (the start's took a worker
    0.25-0.5 s and the scheduler 0.25 s, on the critical path of an engine's start), and none
    writes to the pages of ours (a copy of each page a walk touched)."""
    gc.freeze()
    return os.fork()


_schedulers_of: set[tuple[str, ...]] = set()  # the models (and grammar tables) a scheduler was forked for


def _prepare(request: dict[str, Any]) -> None:
    """Before forking a scheduler of a model it has forked one of before: the model's tokenizer and
    the grammar backends' tables of it (1.5-1.7 s of a scheduler's CPU at each start, on the
    critical path), and early closing's classes of its vocabulary (``closing_tokens``: 0.2-0.3 s
    more of its CPU, beside the workers' loads), made here and kept, so that this scheduler and
    every later one has them (a client that starts engines again: restarts, replicas, tests). Not
    for a client's first engine,
    whose scheduler makes them beside its workers' loads; they start no thread (``tables.py``).
    A failure here is the scheduler's to meet: it makes them itself."""
    job = request.get("job", {})
    if job.get("role") != "scheduler":
        return
    try:
        from guidespec.config import SchedulerConfig, config_from_dict
        from guidespec.scheduler.grammar import grammar_settings
        from guidespec.model_files import shared_tokenizer
        from guidespec.scheduler.grammar.closing_step import closing_tokens
        from guidespec.scheduler.grammar.compile_process import prepare_grammar_tables

        settings = grammar_settings(config_from_dict(SchedulerConfig, job["config"]))
        key = tuple(str(getattr(settings, f)) for f in ("model_dir", "vocab_size", "stop_token_ids", "default_backend"))
        if key in _schedulers_of:
            prepare_grammar_tables(settings)
            tokenizer = shared_tokenizer(settings.model_dir)
            closing_tokens(tokenizer, settings.vocab_size, settings.stop_token_ids, keep=True)
        _schedulers_of.add(key)
    except Exception:
        logger.debug("the zygote could not make a scheduler's tables", exc_info=True)


def _run_child(request: dict[str, Any], fds: list[int]) -> None:
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for target, fd in zip((1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # as ``python -m`` started there would have it
        os.environ.clear()
        os.environ.update(request["env"])
        from guidespec.launch import child

        child.run(request["job"], os.getppid())
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# ---- the client's side -------------------------------------------------------------------


class ZygoteChild:
    """An engine process forked by the zygote, with the part of ``subprocess.Popen``'s
    interface the launcher uses (``pid``, ``poll``, ``wait``, ``kill``, ``returncode``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)  # signals reach this process, never a reused pid
        except ProcessLookupError:
            self._pidfd = None

    def _set_exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None and self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class Zygote:
    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.watched: set[str] = set()  # the variables whose change the zygote would not follow
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._spawning = threading.Lock()  # one spawn request at a time
        self._lock = threading.Lock()  # the children table
        self._children: dict[int, ZygoteChild] = {}
        self._replies: list[ZygoteChild] = []
        self._replied = threading.Condition()
        self.alive = False
        self.retired = False
        self._started = threading.Event()
        self._failure = f"its imports took over {_READY_TIMEOUT_S:.0f} s"
        self.process: subprocess.Popen[bytes] | None = None
        # The zygote is started by the thread that then listens to it for as long as this process
        # lives: its parent-death signal (which Linux ties to the starting thread) fires when this
        # process dies, whichever thread asked for the first engine.
        threading.Thread(target=self._run, args=(theirs,), name="guidespec-zygote", daemon=True).start()
        if not self._started.wait(_READY_TIMEOUT_S) or not self.alive:
            if self.process is not None:
                self.process.kill()
                self.process.wait()
            self.sock.close()
            raise RuntimeError(f"the zygote did not start: {self._failure}")

    def _run(self, theirs: socket.socket) -> None:
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "guidespec.launch.zygote", str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            theirs.close()
            data = self.sock.recv(_MAX_MESSAGE)
        except OSError as e:
            self._failure = str(e)
            self._started.set()
            return
        ready = json.loads(data) if data else {"error": "it exited"}
        if "ready" not in ready:
            self._failure = str(ready.get("error", ready))
        elif ready.get("threads", 1) != 1:  # a fork would copy a thread's half-done state: don't
            self._failure = f"it runs {ready['threads']} Python threads after its imports"
        else:
            self.watched = set(ready.get("read", ()))
            self.alive = True
        self._started.set()
        if self.alive:
            self._listen()

    def _listen(self) -> None:
        while True:
            try:
                data = self.sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "exit" in message:
                with self._lock:
                    child = self._children.pop(message["exit"], None)
                    done = self.retired and not self._children
                if child is not None:
                    child._set_exit(int(message["code"]))
                    child._close()
                if done:
                    self._stop()
            else:  # a spawn's pid: registered here, before its exit can be read
                child = ZygoteChild(int(message["pid"]))
                with self._lock:
                    self._children[child.pid] = child
                with self._replied:
                    self._replies.append(child)
                    self._replied.notify_all()
        # the zygote is gone, and with it (parent-death signal) whatever it forked
        self.alive = False
        with self._replied:
            self._replied.notify_all()
        with self._lock:
            children, self._children = list(self._children.values()), {}
        for child in children:
            child.kill()
            child._set_exit(-signal.SIGKILL)
            child._close()
        if self.process is not None:  # (it is exiting: reaped here, not left a zombie)
            try:
                self.process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def retire(self) -> None:
        """No more spawns: the zygote exits once the engine processes it forked have."""
        with self._lock:
            self.retired = True
            done = not self._children
        if done:
            self._stop()

    def _stop(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)  # its end of file: it exits, and so does _listen
        except OSError:
            pass

    def spawn(self, job: dict[str, Any]) -> ZygoteChild:
        request = {"job": job, "cwd": os.getcwd(), "env": dict(os.environ)}
        with self._spawning:
            _send(self.sock, request, [1, 2])  # this process's stdout and stderr, as a child inherits them
            with self._replied:
                if not self._replied.wait_for(lambda: self._replies or not self.alive, _REPLY_TIMEOUT_S):
                    raise RuntimeError("the zygote did not answer a spawn request")
                if not self._replies:
                    raise RuntimeError("the zygote exited")
                return self._replies.pop(0)

    def changed(self, env: dict[str, str]) -> list[str]:
        """The variables whose value in ``env`` its imports would have seen differently."""
        native = {k for k in env.keys() | self.env.keys() if k.startswith(_NATIVE_PREFIXES)}
        keys = (self.watched | native) - set(_READ_WHEN_USED)
        return sorted(k for k in keys if env.get(k) != self.env.get(k))


_zygote: Zygote | None = None
_zygote_failed = False
_zygote_lock = threading.Lock()


EngineProcess = ZygoteChild | subprocess.Popen[bytes]


def spawn_engine_process(job: dict[str, Any], device: str) -> EngineProcess:
    """An engine process running ``job`` (role, configuration) for an engine on ``device``:
    forked by this client's zygote where one serves (``envs.zygote``), otherwise
    ``python -m guidespec.launch.child`` with the job on stdin."""
    zygote = _the_zygote() if envs.zygote(device) else None
    if zygote is not None:
        try:
            return zygote.spawn(job)
        except (OSError, RuntimeError, ValueError) as e:
            logger.warning("the zygote failed (%s): engine processes start as new interpreters", e)
    process = subprocess.Popen(
        [sys.executable, "-m", "guidespec.launch.child"], stdin=subprocess.PIPE, start_new_session=True
    )
    assert process.stdin is not None
    process.stdin.write(json.dumps(job).encode())
    process.stdin.close()
    return process


def _forget_in_child() -> None:
    """A fork of the client (its own multiprocessing, say) starts a zygote of its own if it needs
    one: this one answers the client, and its socket must close when the client dies."""
    global _zygote, _zygote_lock
    if _zygote is not None:
        _zygote.sock.close()
    _zygote, _zygote_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def warm_up(device: str) -> None:
    """Start this client's zygote now, on a thread of its own, where an engine on ``device`` will
    want one: its imports overlap the client's own work before the engine starts (the tokenizer,
    the model's files)."""
    if envs.zygote(device) and (_zygote is None or not _zygote.alive) and not _zygote_failed:
        threading.Thread(target=_the_zygote, name="guidespec-zygote-start", daemon=True).start()


_GPU_NODES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's driver's, ROCm's: CUDA or HIP could be there


def warm_up_before_torch(device: str) -> None:
    """``warm_up`` for an engine on ``device`` as asked ("auto", "cpu", "cuda"), before torch is
    imported to resolve it: a CPU engine's, where ``device`` is "cpu", or "auto" on a machine
    without a GPU's device nodes (where torch finds no GPU either). The zygote's imports (~3 s of
    CPU) then run beside the client's own (torch, transformers: ~2.4 s), not after them. Elsewhere
    nothing: ``create_engine_config`` starts it once torch has said."""
    if device == "cpu" or (device == "auto" and not any(os.path.exists(node) for node in _GPU_NODES)):
        warm_up("cpu")


def _the_zygote() -> Zygote | None:
    global _zygote, _zygote_failed
    if not hasattr(os, "pidfd_open"):  # Linux 5.3 and later
        return None
    with _zygote_lock:
        if _zygote is not None and _zygote.alive:
            changed = _zygote.changed(dict(os.environ))
            if not changed:
                return _zygote
            logger.info("the environment changed (%s): a new zygote", ", ".join(changed))
            _zygote.retire()
        if _zygote_failed:
            return None
        try:
            _zygote = Zygote()
        except (OSError, RuntimeError, ValueError) as e:
            _zygote_failed = True
            logger.warning("no zygote (%s): engine processes start as new interpreters", e)
            return None
        return _zygote


if __name__ == "__main__":
    main()
    os._exit(0)  # without the interpreter's teardown of torch and the rest (~1 s)
