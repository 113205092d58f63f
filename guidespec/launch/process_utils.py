"""Small helpers every engine process runs at start: die with the parent, ignore Ctrl-C
(the parent shuts the engine down), quiet logging."""

from __future__ import annotations

import ctypes
import logging
import os
import signal

from guidespec import envs

_PR_SET_PDEATHSIG = 1


def setup_child_process(name: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the loops also check the parent pid
    logging.basicConfig(level=envs.log_level(), format=f"%(asctime)s {name} %(levelname)s %(message)s")


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid
