"""``CoreShare`` (``worker/core_share.py``): when a CPU rank 0 gives the scheduler a core back for
masked steps' forwards, and when it takes it again, from the steps' own timings."""

from __future__ import annotations

import pytest

from guidespec.worker import kernels
from guidespec.worker.core_share import CoreShare

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the kernels are not built")


def test_only_a_team_that_takes_every_core_shares_one() -> None:
    assert CoreShare.create(2, cores=2) is not None
    assert CoreShare.create(4, cores=4) is not None
    assert CoreShare.create(1, cores=1) is None  # (no thread to give)
    assert CoreShare.create(2, cores=4) is None  # (the scheduler has a core of its own)


def test_steps_that_wait_for_their_masks_narrow_the_team_and_forward_bound_ones_widen_it() -> None:
    share = CoreShare.create(2, cores=2)
    assert share is not None
    before = kernels.loader.threads()
    try:
        kernels.set_threads(2)
        for _ in range(10):  # the mask comes a tenth of the forward late: the forward is what they wait for
            share.observe(forward_s=1e-3, wait_s=1e-4)
            assert not share.narrow and not share.begin()
        for step in range(10):  # each step waits for its mask as long as its forward took
            share.observe(forward_s=1e-3, wait_s=1e-3)
        assert share.narrow
        assert share.begin() and kernels.loader.threads() == 1
        share.end()
        assert kernels.loader.threads() == 2
        share.observe(forward_s=2e-3, wait_s=0.0)  # one step's mask on time does not widen it
        assert share.narrow
        for _ in range(20):  # on one thread the forward is now what they wait for (the mean forgets)
            share.observe(forward_s=2e-3, wait_s=0.0)
        assert not share.narrow and not share.begin()
        assert kernels.loader.threads() == 2
    finally:
        kernels.set_threads(before)
