"""``CoreShare`` (``worker/core_share.py``): when a CPU rank 0 gives the scheduler a core back for
masked steps' forwards, and when it takes it again, from the steps' own timings."""

from __future__ import annotations

from typing import Iterator

import pytest

from guidespec.worker import kernels
from guidespec.worker.core_share import _BACKOFF, _JUDGE, _RECHECK, _SETTLE, CoreShare

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the kernels are not built")


@pytest.fixture
def share() -> Iterator[CoreShare]:
    before = kernels.loader.threads()
    kernels.set_threads(2)
    made = CoreShare.create(2, cores=2)
    assert made is not None
    yield made
    kernels.set_threads(before)


def _run(share: CoreShare, steps: int, whole: tuple[float, float], narrowed: tuple[float, float]) -> list[bool]:
    """``steps`` masked steps whose (forward, wait) is ``whole`` on the whole team and ``narrowed``
    on one thread fewer; whether each ran narrowed."""
    modes = []
    for _ in range(steps):
        narrow = share.narrow
        share.begin()
        assert kernels.loader.threads() == (1 if narrow else 2)
        share.end()
        assert kernels.loader.threads() == 2
        modes.append(narrow)
        share.observe(*(narrowed if narrow else whole))
    return modes


def test_only_a_team_that_takes_every_core_shares_one() -> None:
    assert CoreShare.create(2, cores=2) is not None
    assert CoreShare.create(4, cores=4) is not None
    assert CoreShare.create(1, cores=1) is None  # (no thread to give)
    assert CoreShare.create(2, cores=4) is None  # (the scheduler has a core of its own)


def test_steps_whose_masks_come_on_time_keep_the_whole_team(share: CoreShare) -> None:
    assert not any(_run(share, 500, whole=(1e-3, 1e-4), narrowed=(2e-3, 0.0)))


def test_steps_that_wait_for_their_masks_narrow_it_while_that_takes_less(share: CoreShare) -> None:
    """A forward of 1 ms waiting 1.3 ms for its mask on the whole team; 1.6 ms and 0.2 narrowed:
    narrowed it stays, but for the whole team's re-timing every ``_RECHECK`` steps."""
    modes = _run(share, 1000, whole=(1e-3, 1.3e-3), narrowed=(1.6e-3, 0.2e-3))
    first = modes.index(True)
    assert first == _SETTLE + _JUDGE
    assert sum(modes[first:]) / len(modes[first:]) > 0.9
    assert modes[first : first + _RECHECK] == [True] * _RECHECK


def test_a_narrowing_that_takes_longer_is_undone_and_tried_less_and_less(share: CoreShare) -> None:
    """Narrowed, the forward doubles and the mask still comes after it: the trial loses each time,
    and is tried again after 64, 128, ... masked steps."""
    modes = _run(share, 2000, whole=(1e-3, 0.6e-3), narrowed=(2e-3, 0.1e-3))
    starts = [i for i in range(1, len(modes)) if modes[i] and not modes[i - 1]]
    assert len(starts) >= 3
    assert all(modes[s : s + _SETTLE + _JUDGE] == [True] * (_SETTLE + _JUDGE) for s in starts)
    assert sum(modes) == len(starts) * (_SETTLE + _JUDGE)  # (each trial: its settling and judging steps)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[0] >= _BACKOFF[0] and all(later > earlier for earlier, later in zip(gaps, gaps[1:]))
