"""A CPU rank 0 whose kernels take every core leaves one to the scheduler while the scheduler is
what its steps wait for.

While a step's forward runs, the scheduler advances the step before's grammars and fills this
step's bitmask (async scheduling), and the forward then waits for it. On a host whose cores the
kernels' team takes all of, the scheduler shares a core with a kernel thread. Where the steps wait
for their masks, the forward's speed is not what they wait for: with the share, the tiny model's
JSON array at 64 rows on 2 cores ran at 0.94-1.08 of unguided's tokens a second, 0.72-0.88
without (``overhead.py``, four alternating pairs; the regex 0.69-0.78 against 0.63-0.79).

``CoreShare`` decides from the steps' own timings, as a trial: while masked steps run with the
whole team it keeps a running mean of each one's wait for its bitmask over its forward; once that
is half or more (the forward, on one thread fewer, could still end about when the mask comes), their
forwards run on one thread fewer, and after a few steps the two are compared by what a step waits
for before its picks, its forward and its wait for the mask together. A narrowing that does not
take less is undone and not tried again for 64 masked steps, doubling to 4096 while they keep
losing; one that does is kept, and every 256 steps the whole team is timed again. Unmasked steps,
a draft model's and the fused ones keep the whole team.
"""

from __future__ import annotations

import logging
import os

from guidespec.worker import kernels

logger = logging.getLogger(__name__)

_MEMORY = 0.2  # the running means' weight of a step
_NARROW_AT = 0.5  # a masked step's wait for its mask over its forward (the whole team's mean) that tries narrowing
_SETTLE = 4  # steps after a change-over left out of the means
_JUDGE = 8  # steps then counted before a narrowing is judged
_RECHECK = 256  # narrowed steps before the whole team is timed again
_BACKOFF = (64, 4096)  # masked steps before a narrowing that lost is tried again (doubling)


class CoreShare:
    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.narrow = False  # whether masked steps' forwards run on one thread fewer
        self._seen = 0  # masked steps since the last change-over
        self._ratio = 0.0  # the whole team's running mean of wait / forward
        self._took = 0.0  # the current mode's running mean of forward + wait
        self._whole = 0.0  # the whole team's, when it last ran
        self._backoff = _BACKOFF[0]
        self._steps = 0  # masked steps seen
        self._retry_at = 0  # (a count of them) before which no narrowing is tried

    @staticmethod
    def create(threads: int, cores: int | None = None) -> CoreShare | None:
        """One for a CPU rank 0 whose kernels' team (``threads``) leaves the scheduler no core of
        its own, where it has a thread to give; None elsewhere."""
        cores = cores if cores is not None else len(os.sched_getaffinity(0))
        return CoreShare(threads) if kernels.available() and threads >= 2 and threads + 1 > cores else None

    def begin(self) -> None:
        """Before a masked step's forward: narrow the team where it is narrowed (the helper left
        out sleeps: ``kernels.park_threads``); ``end`` widens it again."""
        if self.narrow:
            kernels.park_threads()
            kernels.set_threads(self.threads - 1)

    def end(self) -> None:
        kernels.set_threads(self.threads)

    def observe(self, forward_s: float, wait_s: float) -> None:
        """A masked step's forward, and its wait for its bitmask after it."""
        self._steps += 1
        self._seen += 1
        if self._seen <= _SETTLE:
            return
        took, ratio = forward_s + wait_s, wait_s / max(forward_s, 1e-6)
        if self._seen == _SETTLE + 1:
            self._took, self._ratio = took, ratio
        else:
            self._took += _MEMORY * (took - self._took)
            self._ratio += _MEMORY * (ratio - self._ratio)
        if self._seen < _SETTLE + _JUDGE:
            return
        if not self.narrow:
            if self._ratio >= _NARROW_AT and self._steps >= self._retry_at:
                self._whole = self._took
                self._switch()
        elif self._seen == _SETTLE + _JUDGE and self._took >= self._whole:  # the narrowing lost
            self._retry_at = self._steps + self._backoff
            self._backoff = min(2 * self._backoff, _BACKOFF[1])
            self._switch()
        elif self._seen == _SETTLE + _JUDGE:
            self._backoff = _BACKOFF[0]
        elif self._seen >= _RECHECK:  # (it narrows again at once where the wait is still long)
            self._switch()

    def _switch(self) -> None:
        self.narrow, self._seen = not self.narrow, 0
        logger.debug(
            "masked forwards: %d threads (wait / forward %.2f, forward + wait %.3f ms, the whole team's %.3f)",
            self.threads - self.narrow,
            self._ratio,
            self._took * 1e3,
            self._whole * 1e3,
        )
