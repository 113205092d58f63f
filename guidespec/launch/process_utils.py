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
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(f"gs-{name}"[:15].encode()))
    except OSError:
        pass  # not Linux: the loops also check the parent pid
    logging.basicConfig(level=envs.log_level(), format=f"%(asctime)s {name} %(levelname)s %(message)s")


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid
