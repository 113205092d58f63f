"""Linux futexes on a 32-bit word in shared memory, called through libc's ``syscall``.

A process that waits for another's message sleeps in the kernel on a "bell" word and wakes as
soon as the writer rings it (adds one, then wakes the sleepers). A sleep loop instead wakes on
its own clock: with the ring's doubling sleeps, a worker waiting through the scheduler's ~1 ms
between two steps woke ~0.3 ms after its inputs were there. No compiler is needed; where there
is no futex (not Linux, an unknown machine), :func:`available` is False and callers poll.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import sys
from functools import lru_cache

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238, "riscv64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE: the word is shared between processes
_WAKE_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@lru_cache(maxsize=1)
def _syscall() -> tuple[ctypes._CFuncPtr, int] | None:  # type: ignore[name-defined]
    number = _SYS_FUTEX.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    call = libc.syscall  # the GIL is released while a ctypes call runs
    call.restype = ctypes.c_long
    return call, number


def available() -> bool:
    return _syscall() is not None


def wait(address: int, seen: int, timeout_s: float) -> None:
    """Sleep while the uint32 at ``address`` still holds ``seen``, at most ``timeout_s``; returns
    at once if it no longer does. The caller checks its condition again after (a wake-up can be
    spurious)."""
    found = _syscall()
    if found is None:
        return
    call, number = found
    nanoseconds = max(0, int(timeout_s * 1e9))
    timeout = _Timespec(nanoseconds // 1_000_000_000, nanoseconds % 1_000_000_000)
    call(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_long(_FUTEX_WAIT),
        ctypes.c_long(seen & 0xFFFFFFFF),
        ctypes.byref(timeout),
        ctypes.c_void_p(None),
        ctypes.c_long(0),
    )


def wake(address: int) -> None:
    """Wake every process sleeping on the uint32 at ``address``."""
    found = _syscall()
    if found is None:
        return
    call, number = found
    call(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_long(_FUTEX_WAKE),
        ctypes.c_long(_WAKE_ALL),
        ctypes.c_void_p(None),
        ctypes.c_void_p(None),
        ctypes.c_long(0),
    )
