"""Shared-memory segments of owners that died are removed by the next owner; a live owner's never
(real processes, real segments under /dev/shm)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from guidespec.ipc import segments
from guidespec.ipc.shm_ring import ShmRing

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="segments are files under /dev/shm on Linux")

# a process that makes a ring, says so, then dies as a killed Ray replica does: SIGKILL, with no
# resource tracker left to clean up after it (unregistered here: the kill took it along)
_OWNER = """
import os, signal, sys
from multiprocessing import resource_tracker
from guidespec.ipc.shm_ring import ShmRing
ring = ShmRing.create(sys.argv[1], 1, 4, 4096)
print("made", flush=True)
if sys.argv[2] == "die":
    resource_tracker.unregister("/" + sys.argv[1], "shared_memory")
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.read()  # (until the test closes it)
ring.close()
print("closed", flush=True)
"""


def _name() -> str:
    return f"{segments.PREFIX}test-{uuid.uuid4().hex[:12]}"


def _path(name: str) -> str:
    return os.path.join("/dev/shm", name)


def _owner(name: str, how: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", _OWNER, name, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "made"
    return process


def test_a_killed_owners_segment_is_removed_and_a_young_one_kept() -> None:
    name = _name()
    process = _owner(name, "die")
    assert process.wait(timeout=30) < 0
    assert os.path.exists(_path(name))  # (left behind)
    try:
        assert name not in segments.remove_orphans()  # younger than the grace: its maker may not have locked it yet
        assert os.path.exists(_path(name))
        assert name in segments.remove_orphans(min_age_s=0)
        assert not os.path.exists(_path(name))
    finally:
        if os.path.exists(_path(name)):
            os.unlink(_path(name))


def test_a_new_owner_removes_orphans_first(monkeypatch: pytest.MonkeyPatch) -> None:
    orphan = _name()
    assert _owner(orphan, "die").wait(timeout=30) < 0
    monkeypatch.setattr(segments, "_GRACE_S", 0.0)
    ring = ShmRing.create(_name(), 1, 4, 4096)
    try:
        removed = not os.path.exists(_path(orphan))
    finally:
        ring.close()
        if os.path.exists(_path(orphan)):
            os.unlink(_path(orphan))
    assert removed


def test_live_owners_segments_are_never_removed() -> None:
    name, own_name = _name(), _name()
    process = _owner(name, "live")
    own = ShmRing.create(own_name, 1, 4, 4096)  # this process's own, through another descriptor than its lock's
    try:
        removed = segments.remove_orphans(min_age_s=0)
        assert name not in removed and own_name not in removed
        assert os.path.exists(_path(name)) and os.path.exists(_path(own_name))
    finally:
        own.close()
        assert process.stdin is not None and process.stdout is not None
        process.stdin.close()
        assert process.stdout.readline().strip() == "closed"
        process.wait(timeout=30)
    assert not os.path.exists(_path(name)) and not os.path.exists(_path(own_name))  # (each owner removed its own)
