"""Small helpers every engine process runs at start: die with the parent, ignore Ctrl-C
(the parent shuts the engine down), quiet logging."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import threading

from guidespec import envs

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def setup_child_process(name: str) -> None:
    """``name`` also becomes the process name ``gs-<name>`` (``ps -o comm``, ``/proc/PID/comm``),
    so an operator (or a test) can tell the scheduler from each worker rank."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    set_process_name(name)
    logging.basicConfig(level=envs.log_level(), format=f"%(asctime)s {name} %(levelname)s %(message)s")


def freeze_startup_objects() -> int:
    """Collect the garbage of a process's start, then keep the objects left out of every later
    collection (``gc.freeze``); returns how many. A scheduler holds ~240,000 tracked objects after
    its start (the tokenizer, the vocabulary's tables): a full collection during serving walked
    them all, 128-237 ms in the middle of a step, stalling every request; frozen, a collection
    walks only what came since."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def die_with_parent() -> None:
    """SIGKILL when the thread that started this process ends (Linux; elsewhere the loops also
    check the parent pid)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def set_process_name(name: str) -> None:
    """``gs-<name>`` as the process's name (``ps -o comm``, ``/proc/PID/comm``), on Linux."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(f"gs-{name}"[:15].encode()))
    except OSError:
        pass


def kill_group(pid: int) -> None:
    """SIGKILL to what is left of the process group ``pid`` leads (each engine process leads a
    session of its own; the scheduler's compile process leads another, and dies with the
    scheduler's thread that started it: ``background_process``)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def lower_thread_priority(increment: int) -> None:
    """Raise the calling thread's nice value by ``increment`` (Linux: a thread's own, inherited by
    the threads it starts afterwards; a process's other threads keep theirs). Background work that
    must not take the cores from serving (grammar compiles) runs so: on a host whose cores are all
    busy it gets what serving leaves, and costs nothing where a core is free. Not undone: only a
    privileged process can lower a nice value again."""
    if increment <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError:  # (a sandbox that refuses it: the work runs at the usual priority)
        logging.getLogger(__name__).debug("could not lower thread %d's priority", tid, exc_info=True)


def background_process(increment: int) -> None:
    """Make this process background work: a session of its own whose scheduling group's nice is
    raised by ``increment``, and this thread's too (:func:`lower_thread_priority`). Where the
    kernel groups tasks by session (``/proc/sys/kernel/sched_autogroup_enabled``, the default of
    many distributions), the cores are shared fairly between sessions first and a nice value
    counts only inside one: a compile process in the scheduler's session took a whole core of
    two from the worker's session (each of its two threads ran ~125 ms of every 250 beside the
    worker's two), at nice 10 and even as SCHED_IDLE. Leaving the session also leaves the process
    group: this process must die by other means (``die_with_parent``)."""
    if increment <= 0:
        return
    try:
        os.setsid()
    except OSError:  # (already a session leader)
        pass
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(increment))
    except OSError:  # no autogroups here: the threads' own nice values decide
        pass
    lower_thread_priority(increment)
