"""Whether a drafter's drafts pay for the whole step, measured: the draft gate.

The adaptive plan (``proposer.py``) weighs each draft token against the forward's cost of one
more token. A drafter's drafts cost more than that: the scheduler proposes them (prompt lookup:
~90 µs a row at 64 JSON rows on 2 cores, its share of a py-spy profile), checks them against the
grammar, fills a bitmask row at each draft depth and verifies them; rank 0 masks and samples a
row of logits for each; and a step with drafts waits for the step before's tokens, where a step
without them runs ahead of them (async scheduling). Where the forward is cheap beside all that (a
large batch, a small model, a GPU) the plan drafts at a loss it cannot see: SmolLM2's config with
random weights, 64 JSON rows on 2 cores, drafted 3.7 tokens a row a step and made 9.7k tokens a
second, 16k without drafts.

So the gate measures it. It times the steps from one emit to the next (less the forward's time
for the prompt tokens a step computed, by the plan's cost model) and counts the tokens they gave,
in the mode it is in (drafting, or not). Every ``interval`` such steps it tries the other mode for
``WINDOW`` steps (after ``SETTLE`` steps of change-over) and keeps the mode it is in unless the
other gave ``MARGIN`` more tokens a second.
The interval starts at ``FIRST`` and grows while the mode it is in keeps winning (x4 where it won
by ``DECISIVE``, else x2, up to ``LONGEST``), and at least so far that the time the lost trial
took beyond what the kept mode would have (its change-over counted) is ``TRIAL_SHARE`` of the
time until the next: 64 JSON rows of the tiny model drafting at 10k tokens/s against 25k without
would otherwise try drafts again 256 steps on, a tenth of that time lost to each trial.
Where drafting already gives ``DECISIVE`` more tokens a second than a token a row in rank 0's own
time for the rows could (its forward, masking and sampling, fit by tokens as the plan's cost
model is: ``Speculator.plain_bound``, only where recent steps had about that few tokens), no trial
runs, once a trial at the batch's size has kept drafting: a model whose forward is most of a step
keeps drafting without more. Not before: that time is measured while drafting, whose scheduler
work slows rank 0 too where they share few cores (64 JSON rows of the tiny model on 2 cores: the
bound said at most 5.7-6.4k tokens/s without drafts where trials found 11-25k, and two runs of
three drafted at a loss to the end without a trial, JSON + n-gram ÷ unguided 0.58 and 0.59).
A batch whose size changed by ``RESIZE`` or more since the last decision takes the verdict
last reached at its size (sizes in steps of ``RESIZE``: the mode and the interval then; a trial
under way ends without a verdict), or without one is tried again ``FIRST`` steps after it: a
server's batches come and go at the sizes its load gives, and each new one at a size whose drafts
lost would otherwise draft at a loss until its first trial (64 JSON rows of the tiny model, 256
tokens each: 64 of its ~250 steps).
Closed, the requests still draft their grammars' forced tokens (jump-forward), and with async
scheduling the steps run ahead as without a drafter.
"""

from __future__ import annotations

import collections
import logging
import math

logger = logging.getLogger(__name__)

FIRST = 64  # steps measured before the first trial
WINDOW = 12  # steps a mode is judged on
SETTLE = 2  # steps of a trial not judged: the change-over (steps in flight, the drafter catching up)
MARGIN = 0.15  # a trial wins by this much or the gate stays as it is (a window is noisy)
DECISIVE = 0.3  # a mode that wins by this much is tried against less often (x4, not x2)
LONGEST = 4096  # the longest interval between trials, in steps measured
RESIZE = 1.5  # a batch grown or shrunk by this factor since the last decision is tried again soon
TRIAL_SHARE = 0.02  # a trial that lost is next made once this share of the time is what it cost
IDLE = 0.5  # a step planned this share of its own time after the emit before it followed an idle engine


class DraftGate:
    def __init__(self, open: bool = True) -> None:
        self.open = open  # drafting, outside a trial
        self.interval = FIRST
        self._steps = 0  # steps judged in the mode since the last decision
        self._recent: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=WINDOW)
        self._trial: list[tuple[float, int, int]] | None = None  # the other mode's steps while it is tried
        self._settle = 0
        self._rows = 0.0  # the batch size the last decision saw
        self._verdicts: dict[int, tuple[bool, int]] = {}  # a size's step (_size_step) -> (open, interval) there
        self._last_end: float | None = None

    @property
    def drafting(self) -> bool:
        """Whether the next plan drafts."""
        return self.open != (self._trial is not None)

    def observe(
        self,
        drafted: bool,
        tokens: int,
        rows: int,
        times: tuple[float, float],
        prompt_s: float = 0.0,
        ceiling: float = math.inf,
    ) -> None:
        """A step planned with drafts or without, whose ``rows`` gave ``tokens``; ``times``: when it
        was planned and when its emit ended (seconds); ``prompt_s``: the forward's time for the
        prompt tokens it computed, taken off (prompts arrive whatever the mode: serving many
        requests, most steps compute one); ``ceiling``: the most tokens a second steps without
        drafts could give (a token a row in rank 0's time alone), which spares their trial where
        drafting already beats it. A step planned well after the emit before it (an idle engine
        between) is not measured."""
        start, end = times
        last, self._last_end = self._last_end, end
        if last is None or rows == 0 or end <= last or start - last > IDLE * (end - start):
            return
        seconds = end - last - prompt_s
        if seconds <= 0:
            return
        sample = (seconds, tokens, rows)
        if self._rows and not self._rows / RESIZE < rows < self._rows * RESIZE:
            self._resized(rows)
        if self._trial is None:
            if drafted != self.open:  # (a trial's last steps, emitted after it ended; a mode left)
                return
            if not self._rows:
                self._rows = rows
            self._recent.append(sample)
            self._steps += 1
            if self._steps >= self.interval and len(self._recent) == WINDOW:
                # (a verdict at this size: a trial reached it, or the bound after one did)
                if self.open and _size_step(rows) in self._verdicts and _rate(self._recent) > ceiling * (1 + DECISIVE):
                    self._steps, self.interval = 0, min(LONGEST, self.interval * 4)  # a win by the bound
                    self._verdicts[_size_step(rows)] = (self.open, self.interval)
                    logger.info(
                        "draft gate open: %.0f tokens/s drafting, at most %.0f without drafts (%d rows); "
                        "next check in %d steps",
                        _rate(self._recent),
                        ceiling,
                        rows,
                        self.interval,
                    )
                else:
                    self._trial, self._settle = [], SETTLE
            return
        if drafted == self.open:  # (planned before the trial began)
            return
        if self._settle > 0:
            self._settle -= 1
            return
        self._trial.append(sample)
        if len(self._trial) == WINDOW:
            self._decide(self._trial)

    def _resized(self, rows: int) -> None:
        """Another batch: the verdict last reached at its size, else the other mode tried again
        FIRST steps after the last decision at most. A trial under way ends without a verdict: a
        server's batch that ends during a trial would otherwise hand the trial's mode to the next
        batch until its window is full (12 steps of 64 rows drafting at a loss, a round's tail
        of a few rows tried)."""
        self._rows = rows
        self._recent.clear()
        self._trial = None
        verdict = self._verdicts.get(_size_step(rows))
        if verdict is None:
            self.interval = min(self.interval, FIRST)
        else:
            self.open, self.interval = verdict
            self._steps = 0

    def _decide(self, trial: list[tuple[float, int, int]]) -> None:
        ours, theirs = _rate(self._recent), _rate(trial)
        rows = sum(r for _, _, r in trial) / len(trial)
        kept = sum(r for _, _, r in self._recent) / len(self._recent)
        self._trial, self._steps, self._rows = None, 0, rows
        if not kept / RESIZE < rows < kept * RESIZE:  # the batch changed meanwhile: no verdict
            self._recent.clear()
            return
        drafting, plain = (ours, theirs) if self.open else (theirs, ours)
        if theirs > ours * (1 + MARGIN):
            self.open = not self.open
            self.interval = FIRST
            self._recent = collections.deque(trial, maxlen=WINDOW)
        else:  # (the time a lost trial took beyond what the mode kept would have: TRIAL_SHARE at most)
            grown = self.interval * (4 if ours > theirs * (1 + DECISIVE) else 2)
            lost = (sum(s for s, _, _ in trial) - sum(t for _, t, _ in trial) / ours) if ours > 0 else 0.0
            step_s = sum(s for s, _, _ in self._recent) / len(self._recent)
            paid = math.ceil(lost * (WINDOW + SETTLE) / WINDOW / (TRIAL_SHARE * step_s)) if step_s > 0 else 0
            self.interval = min(LONGEST, max(grown, paid))
        self._verdicts[_size_step(rows)] = (self.open, self.interval)
        logger.info(
            "draft gate %s: %.0f tokens/s drafting, %.0f without drafts (%.0f rows); next trial in %d steps",
            "open" if self.open else "closed",
            drafting,
            plain,
            rows,
            self.interval,
        )


def _rate(samples: collections.deque[tuple[float, int, int]] | list[tuple[float, int, int]]) -> float:
    """Tokens a second over the samples."""
    seconds = sum(s for s, _, _ in samples)
    return sum(t for _, t, _ in samples) / seconds if seconds > 0 else 0.0


def _size_step(rows: float) -> int:
    """A batch size's step in a scale of ``RESIZE`` (the verdicts' sizes)."""
    return round(math.log(max(rows, 1.0)) / math.log(RESIZE))
