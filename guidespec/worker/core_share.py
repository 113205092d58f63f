"""A CPU rank 0 whose kernels take every core leaves one to the scheduler while the scheduler is
what its steps wait for.

While a step's forward runs, the scheduler advances the step before's grammars and fills this
step's bitmask (async scheduling), and the forward then waits for it. On a host whose cores the
kernels' team takes all of, the scheduler shares a core with a kernel thread. Where the steps wait
for their masks, the forward's speed is not what they wait for: with the share, the tiny model's
JSON array at 64 rows on 2 cores ran at 0.92-0.98 of unguided's tokens a second, 0.87-0.90
without (``overhead.py``, four pairs of runs; the regex 0.79-0.85 against 0.64-0.76).

``CoreShare`` decides per step from the steps' own timings: while the masked steps run with the
whole team it watches how long each waited for its bitmask against how long its forward took (a
running mean), and once the wait is half the forward or more (the forward, on one thread fewer,
would still end about when the mask comes), their forwards run on one thread fewer; it goes back
to the whole team once those steps' masks are there, mostly, when their forward ends (the forward
is what they wait for). Unmasked steps, a draft model's and the fused ones keep the whole team.
"""

from __future__ import annotations

import logging
import os

from guidespec.worker import kernels

logger = logging.getLogger(__name__)

_MEMORY = 0.2  # the running means' weight of a step
_NARROW_AT = 0.5  # a masked step's wait for its mask, over its forward, that narrows the team
_WIDEN_AT = 0.05  # and, with the team narrowed, that widens it again
_SETTLE = 4  # steps in a mode before its mean decides


class CoreShare:
    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.narrow = False  # whether masked steps' forwards run on one thread fewer
        self._ratio = 0.0  # the running mean of wait / forward in the current mode
        self._seen = 0  # steps seen in the current mode

    @staticmethod
    def create(threads: int, cores: int | None = None) -> CoreShare | None:
        """One for a CPU rank 0 whose kernels' team (``threads``) leaves the scheduler no core of
        its own, where it has a thread to give; None elsewhere."""
        cores = cores if cores is not None else len(os.sched_getaffinity(0))
        return CoreShare(threads) if kernels.available() and threads >= 2 and threads + 1 > cores else None

    def begin(self) -> bool:
        """Before a masked step's forward: narrow the team where it is narrowed (the helper left
        out sleeps: ``kernels.park_threads``). Returns whether it did; ``end`` undoes it."""
        if not self.narrow:
            return False
        kernels.park_threads()
        kernels.set_threads(self.threads - 1)
        return True

    def end(self) -> None:
        kernels.set_threads(self.threads)

    def observe(self, forward_s: float, wait_s: float) -> None:
        """A masked step's forward, and its wait for its bitmask after it."""
        ratio = wait_s / max(forward_s, 1e-6)
        self._ratio = ratio if not self._seen else (1 - _MEMORY) * self._ratio + _MEMORY * ratio
        self._seen += 1
        if self._seen < _SETTLE:
            return
        if (self._ratio >= _NARROW_AT) if not self.narrow else (self._ratio <= _WIDEN_AT):
            self.narrow, self._seen = not self.narrow, 0
            logger.debug(
                "masked steps' forwards: %d threads (wait / forward %.2f)", self.threads - self.narrow, self._ratio
            )
