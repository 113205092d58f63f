"""Shared-memory segments: made and removed by one owner, attached by the others, and never
left behind by an owner that dies.

An engine's ring (``shm_ring.py``), mask arena (``mask_arena.py``) and draft channel
(``cuda_ext/channel.py``) are POSIX shared memory, files under ``/dev/shm`` on Linux. Their owner,
the engine's launcher, removes them when it shuts down; an owner killed outright (a Ray replica
killed with its resource tracker, an out-of-memory kill) leaves them there: a 16 MB ring and an
arena each time, until the host's shared memory fills.

So an owner holds a shared ``flock`` on each segment it makes for as long as it lives (the
kernel drops a dead process's locks, however it died), and whoever makes a segment first removes
the ``guidespec-`` segments whose lock it can take exclusively: nobody holds those. A lock, unlike
a pid, also holds across pid namespaces (containers sharing ``/dev/shm``). A segment younger than
``_GRACE_S`` is left alone: its maker may not have locked it yet. Where segments are not files
(no ``/dev/shm``), nothing is locked or removed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import time
from multiprocessing import resource_tracker, shared_memory

logger = logging.getLogger(__name__)

PREFIX = "guidespec-"  # every engine segment's name starts so (launcher.py)
_DIRECTORY = "/dev/shm"
_GRACE_S = 60.0
_held: dict[str, int] = {}  # a segment this process made -> the descriptor its lock is held on


def create_segment(name: str, size: int) -> shared_memory.SharedMemory:
    """A new segment this process owns (locked until ``close_segment``), once the segments no
    live owner holds are removed."""
    remove_orphans()
    shm = shared_memory.SharedMemory(name=name, create=True, size=size)
    try:
        fd = os.open(os.path.join(_DIRECTORY, shm.name.lstrip("/")), os.O_RDONLY)
    except OSError:
        return shm  # (no segment files here: nothing to lock)
    fcntl.flock(fd, fcntl.LOCK_SH)
    _held[shm.name] = fd
    return shm


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Attach without registering with the resource tracker: only the owner may unlink.

    Before Python 3.13 attaching registers the segment, and the tracker (shared with spawned
    children) would unlink it, or complain, when the attaching process exits.
    """
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, create=False, track=False)  # type: ignore[call-arg]
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        return shared_memory.SharedMemory(name=name, create=False)
    finally:
        resource_tracker.register = register  # type: ignore[assignment]


def close_segment(shm: shared_memory.SharedMemory, owner: bool) -> None:
    """Unmap a segment (its numpy views dropped first by the caller); the owner also removes it
    and lets its lock go."""
    try:
        shm.close()
    except BufferError:
        pass
    if owner:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
        fd = _held.pop(shm.name, None)
        if fd is not None:
            os.close(fd)


def remove_orphans(min_age_s: float | None = None) -> list[str]:
    """Remove the engine segments no live process holds, older than ``min_age_s`` (``_GRACE_S``
    unless given); their names."""
    min_age_s = _GRACE_S if min_age_s is None else min_age_s
    try:
        names = [n for n in os.listdir(_DIRECTORY) if n.startswith(PREFIX)]
    except OSError:
        return []
    removed = []
    now = time.time()
    for name in names:
        path = os.path.join(_DIRECTORY, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # (gone meanwhile, or not ours to read)
        try:
            if now - os.fstat(fd).st_ctime < min_age_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its owner is alive
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue
        finally:
            os.close(fd)
    if removed:
        logger.warning("removed %d shared-memory segments of engines that died: %s", len(removed), ", ".join(removed))
    return removed
