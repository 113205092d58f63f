"""The CPU kernels' thread pool (``kernels/pool.c``): loops from several callers at once, a forked
child's loops, and helpers that sleep when parked. Each case runs in a fresh interpreter on two
threads (the pool's state is per process; a broken pool hangs rather than fails, so each has a
timeout)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from guidespec.worker import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the kernel is not built")

_SETUP = """
import os, threading, time
import numpy as np
import torch
from guidespec.worker import kernels
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
w = kernels.pack(torch.randn(4096, 256, generator=g))
xs = [torch.randn(64, 256, generator=g) for _ in range(4)]
expected = [torch.nn.functional.linear(x, kernels.dense(w)) for x in xs]

expected = [e.numpy() for e in expected]

def check(i):
    got = kernels.linear(xs[i], w).numpy()  # 64 x 4096 x 256: a parallel region
    np.testing.assert_allclose(got, expected[i], atol=1e-3, rtol=1e-4)  # (NumPy: no torch op after a fork)
    return got

def helper_tids():  # the pool's threads (named by pool.c)
    tids = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == "gs-kernels":
                tids.append(tid)
    return tids

def run_ns(tid):
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])
"""

_CONCURRENT = """
firsts = [check(i) for i in range(4)]
errors = []
def caller(i):
    try:
        for _ in range(40):
            assert np.array_equal(check(i), firsts[i])  # bit for bit: who ran which tile does not matter
    except BaseException as e:
        errors.append(e)
threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors
print("ok")
"""

_FORK = """
check(0)  # the parent's helper starts
assert len(helper_tids()) == 1
pid = os.fork()
if pid == 0:
    try:
        before = len(helper_tids())
        check(1)
        after = len(helper_tids())
        # the child's loops get a helper of its own (the parent's is not there)
        os._exit(0 if before == 0 and after == 1 else 3)
    except BaseException:
        os._exit(4)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
print("ok")
"""

_PARK = """
check(0)
(tid,) = helper_tids()
def spun(seconds=0.2):
    start = run_ns(tid)
    time.sleep(seconds)
    return (run_ns(tid) - start) / 1e9
busy = spun()
assert busy > 0.05, f"a helper told to spin for 10 s ran {busy:.3f} s of 0.2"  # (it spins: the set-up)
kernels.park_threads()
time.sleep(0.02)
idle = spun()
assert idle < 0.01, f"a parked helper ran {idle:.3f} s of 0.2"
check(1)  # the next region wakes it
busy_again = spun()
assert busy_again > 0.05, f"after a region the helper ran {busy_again:.3f} s of 0.2"
print("ok")
"""

_BENCHED = """
kernels.set_threads(3)
check(0)
tids = helper_tids()
assert len(tids) == 2, tids
def spun(seconds=0.2):
    start = [run_ns(tid) for tid in tids]
    time.sleep(seconds)
    return sorted((run_ns(tid) - s) / 1e9 for tid, s in zip(tids, start))
first = check(1)
assert min(spun()) > 0.05, "helpers told to spin for 10 s did not (the set-up)"
kernels.set_threads(2)  # a team of two: one helper is left out of the next loops
assert np.array_equal(check(1), first)  # (bit for bit: the team's size changes no result)
time.sleep(0.02)
idle, busy = spun()
assert busy > 0.05, f"the team's helper ran {busy:.3f} s of 0.2"
assert idle < 0.01, f"a helper left out of the team ran {idle:.3f} s of 0.2"
kernels.set_threads(3)
assert np.array_equal(check(1), first)  # the next loop with it in the team wakes it
assert min(spun()) > 0.05, "after a loop of three, a helper slept"
print("ok")
"""


_LATE_HELPER = """
import sys
lib = kernels.load(kernels.build(["-march=native", "-O1", "-DPOOL_PUBLISH_DELAY_NS=50000"]))  # (-O1: a fast build)
kernels.loader.library = lambda: lib
ws = [kernels.pack(torch.randn(n, 64, generator=g)) for n in (160, 4096, 640)]
x = torch.randn(64, 64, generator=g)
firsts = [kernels.linear(x, w).numpy().copy() for w in ws]
for _ in range(400):
    kernels.park_threads()  # (the helper sleeps: the next loop wakes it late, while the caller runs it)
    for w, first in zip(ws, firsts):
        assert np.array_equal(kernels.linear(x, w).numpy(), first)
print("ok")
"""


def _run(script: str, **env: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _SETUP + script],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_callers_on_several_threads_each_get_their_own_loop() -> None:
    """Four Python threads call a parallel kernel at once (ctypes lets go of the GIL): one caller's
    loop runs on the pool, the others' on their own thread; every result is what it is alone."""
    _run(_CONCURRENT)


def test_a_forked_child_starts_helpers_of_its_own() -> None:
    """After a fork the pool has none of the parent's helper threads: the child's first parallel
    loop starts one (a pool that counted the parent's would run every loop on one thread)."""
    _run(_FORK)


def test_parked_helpers_sleep_until_the_next_region() -> None:
    """With a 10 s spin a helper keeps its core after a region; parked, it sleeps at once (the
    worker parks before it waits for the ring or a bitmask), and the next region wakes it."""
    _run(_PARK, GUIDESPEC_KERNEL_SPIN_US="10000000")


def test_a_helper_left_out_of_a_loops_team_sleeps() -> None:
    """A loop on fewer threads than the pool has helpers (the worker leaves a core to the scheduler:
    ``core_share.py``) puts the helpers it leaves out to sleep at once, where they would spin on
    the core they were left out to free; the next loop that wants them wakes them."""
    _run(_BENCHED, GUIDESPEC_KERNEL_SPIN_US="10000000")


def test_a_late_helper_takes_no_chunk_of_a_finished_loop() -> None:
    """A helper woken late for a loop the caller has finished meets the next loop's fields being
    written (a build that waits 50 µs there): it must take nothing, neither a chunk past the old
    loop's end under the new loop's task nor a count that lets the caller return early."""
    _run(_LATE_HELPER)


def test_parking_builds_nothing(tmp_path: Path) -> None:
    """A GPU rank's loop parks the kernels' threads too: where the CPU kernels were never loaded,
    parking must not build them (a compile of seconds in the middle of serving)."""
    script = (
        "from guidespec.worker import kernels\nkernels.park_threads()\nassert not kernels.loader.LOADED\nprint('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "GUIDESPEC_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
    assert not list(tmp_path.rglob("*.so"))
