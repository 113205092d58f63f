"""Small helpers every engine process runs at start: die with the parent, ignore Ctrl-C
(the parent shuts the engine down), quiet logging."""

from __future__ import annotations

import ctypes
import logging
import os
import signal

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
    session of its own: the scheduler's compile process is in its group)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid
