"""The draft gate: an n-gram drafter's drafts are kept where they give more tokens a second than
steps without them, measured over whole steps, and turned off where they give fewer."""

from __future__ import annotations

import pytest

from guidespec.config import SpeculativeConfig
from guidespec.protocol import SamplingParams
from guidespec.scheduler.batching import ScheduledRow
from guidespec.scheduler.request import Request
from guidespec.scheduler.speculation.gate import FIRST, LONGEST, SETTLE, TRIAL_SHARE, WINDOW, DraftGate
from guidespec.scheduler.speculation.proposer import Speculator


class _Host:
    """Steps of a batch of ``rows`` rows that take ``drafting`` or ``plain`` seconds each and
    give ``tokens_drafting`` or ``rows`` tokens, fed to a gate as the scheduler does: each
    step planned in the mode the gate is in, emitted one step later than planned when the
    step ran ahead (the step before's emit comes after the next step is planned)."""

    def __init__(
        self,
        gate: DraftGate,
        rows: int,
        drafting: float,
        plain: float,
        tokens_drafting: int,
        ceiling: float = float("inf"),
    ) -> None:
        self.gate, self.rows, self.ceiling = gate, rows, ceiling
        self.seconds = {True: drafting, False: plain}
        self.tokens = {True: tokens_drafting, False: rows}
        self.now = 0.0
        self.modes: list[bool] = []  # each step's mode, as planned

    def run(self, steps: int, rows: int | None = None) -> None:
        rows = self.rows if rows is None else rows
        in_flight: tuple[bool, float] | None = None  # (its mode, when it was planned)
        for _ in range(steps):
            mode, planned = self.gate.drafting, self.now
            self.modes.append(mode)
            if in_flight is not None:  # the step before, run ahead: emitted now
                before, at = in_flight
                self.now += self.seconds[before]
                self.gate.observe(before, self.tokens[before], rows, (at, self.now), 0.0, self.ceiling)
                in_flight = None
            if mode:
                self.now += self.seconds[mode]
                self.gate.observe(mode, self.tokens[mode], rows, (planned, self.now), 0.0, self.ceiling)
            else:
                in_flight = (mode, planned)


def test_drafts_that_cost_more_than_they_give_are_turned_off_and_tried_again_later() -> None:
    gate = DraftGate()
    # 64 rows: drafting gives 3.7 tokens a row in 20 ms, steps without drafts 1 token in 3 ms
    host = _Host(gate, 64, drafting=0.020, plain=0.003, tokens_drafting=237)
    host.run(FIRST + SETTLE + WINDOW + 2)
    assert not gate.open, "drafting at 11.8k tokens/s against 21k without: the gate closes"
    assert host.modes[: FIRST - 1] == [True] * (FIRST - 1)
    host.modes.clear()
    host.run(4 * FIRST)
    trials = [i for i, mode in enumerate(host.modes) if mode]
    assert trials, "drafting is tried again"
    assert len(trials) <= SETTLE + WINDOW + 2 and not gate.open
    # a decisive loss: tried again once what the trial lost is TRIAL_SHARE of the time between
    # (each of its steps took 20 ms, and 237 tokens at 21.3k tokens/s take 11.1)
    lost = (SETTLE + WINDOW) * (0.020 - 237 * 0.003 / 64)
    assert 4 * FIRST < gate.interval < LONGEST
    assert lost / (gate.interval * 0.003) == pytest.approx(TRIAL_SHARE, rel=0.02)


def test_drafts_that_pay_stay_on_and_are_questioned_less_and_less() -> None:
    gate = DraftGate()
    # one request of a large model: 2.6 tokens a step drafting (12 ms), 1 token without (10 ms)
    host = _Host(gate, 1, drafting=0.012, plain=0.010, tokens_drafting=3)
    host.run(20 * FIRST)
    assert gate.open
    off = host.modes.count(False)
    assert off <= 4 * (SETTLE + WINDOW + 2), f"{off} of {len(host.modes)} steps without drafts"
    assert gate.interval >= 16 * FIRST


def test_no_trial_where_drafting_beats_what_steps_without_drafts_could_give(caplog: pytest.LogCaptureFixture) -> None:
    """After one trial at the batch's size: the bound is rank 0's time measured while drafting,
    which on a host of few cores the scheduler's drafting work slows too."""
    gate = DraftGate()
    # 4 rows at 3 tokens a row in 12 ms (1,000 tokens/s); rank 0 alone takes 8 ms for 4 rows (500/s)
    host = _Host(gate, 4, drafting=0.012, plain=0.008, tokens_drafting=12, ceiling=500.0)
    with caplog.at_level("INFO", logger="guidespec.scheduler.speculation.gate"):
        host.run(40 * FIRST)
    first_trial = [i for i, mode in enumerate(host.modes) if not mode]
    assert first_trial and first_trial[-1] - first_trial[0] < SETTLE + WINDOW + 2  # (one, then none)
    assert gate.open and gate.interval == LONGEST
    assert "1000 tokens/s drafting, 500 without drafts (4 rows)" in caplog.text  # (the trial's verdict)
    assert "1000 tokens/s drafting, at most 500 without drafts (4 rows)" in caplog.text  # (each check after)


def test_a_bound_that_says_drafting_wins_still_has_one_trial_find_the_truth() -> None:
    """64 rows of a tiny model on 2 cores: drafting gave 7.5-9.6k tokens a second and rank 0's
    time measured meanwhile bounded steps without drafts at 5.7-6.4k, which gave 11-25k."""
    gate = DraftGate()
    host = _Host(gate, 64, drafting=0.030, plain=0.005, tokens_drafting=250, ceiling=6000.0)
    host.run(FIRST + SETTLE + WINDOW + 2)
    assert not gate.open, "drafting at 8.3k tokens/s against 12.8k without: the gate closes"


def test_the_interval_is_bounded_and_a_new_batch_size_is_tried_again_soon() -> None:
    gate = DraftGate()
    host = _Host(gate, 8, drafting=0.004, plain=0.004, tokens_drafting=20)
    host.run(60 * FIRST)
    assert gate.open and gate.interval == LONGEST
    # the batch grows eightfold: the next trial comes within FIRST steady steps
    host.modes.clear()
    host.run(FIRST + WINDOW + SETTLE + 4, rows=64)
    assert False in host.modes


def test_a_trial_across_a_change_of_batch_size_decides_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = DraftGate()
    host = _Host(gate, 64, drafting=0.020, plain=0.003, tokens_drafting=237)
    host.run(FIRST + SETTLE + 1)  # the trial of steps without drafts has begun
    assert not gate.drafting
    host.run(WINDOW, rows=8)  # (the batch shrinks during it)
    assert gate.open, "no verdict from a trial whose batch is not the one it is compared with"


def test_a_steps_prompt_work_is_taken_off_and_an_idle_gap_is_not_measured() -> None:
    gate = DraftGate()
    now = 0.0
    for _ in range(FIRST * 4):  # every step computes a prompt chunk that is all of its time (or more)
        gate.observe(True, 64, 64, (now, now + 0.010), prompt_s=0.012)
        now += 0.010
    for _ in range(FIRST * 4):  # every step follows an idle engine
        now += 1.0
        gate.observe(True, 64, 64, (now, now + 0.010))
        now += 0.010
    assert gate.drafting and gate.open and gate.interval == FIRST, "nothing measured, nothing tried"
    # serving: a prompt chunk in every step, taken off: drafts at 9k tokens/s of decoding against
    # 20k without are turned off as without the prompts
    host = _Host(gate, 64, drafting=0.020, plain=0.003, tokens_drafting=180)
    host.run(FIRST + SETTLE + WINDOW + 2)
    assert not gate.open


def _drafts_lost_at_64() -> tuple[DraftGate, _Host]:
    """A gate closed by 64 rows whose drafts lost (11.8k tokens/s against 21k), and their host."""
    gate = DraftGate()
    host = _Host(gate, 64, drafting=0.020, plain=0.003, tokens_drafting=237)
    host.run(FIRST + SETTLE + WINDOW + 2)
    assert not gate.open
    return gate, host


def test_a_trial_under_way_ends_when_a_batch_of_a_judged_size_comes() -> None:
    """A batch's last few rows try drafts (no verdict at their size); the next 64 rows, whose
    drafts lost, take their verdict at once instead of drafting until that trial's window is full."""
    gate, host = _drafts_lost_at_64()
    tail = _Host(gate, 6, drafting=0.003, plain=0.003, tokens_drafting=6)
    tail.now = host.now
    tail.run(FIRST + WINDOW)
    assert tail.modes[-1], "the tail's trial of drafts is under way"
    host.now, host.modes = tail.now, []
    host.run(FIRST)
    assert host.modes.count(True) <= 2, "64 rows again: no drafts (a step of the change-over at most)"
    assert not gate.open


def test_the_bound_on_steps_without_drafts_needs_steps_about_that_small() -> None:
    """Rank 0's time fit over drafting steps of 200-250 tokens says nothing of a step of 64: no
    bound (the gate tries steps without drafts); once such a step is seen, the fit's bound."""
    speculator = Speculator(SpeculativeConfig(method="ngram", max_draft_len=3), grammar=None, max_model_len=1024)
    for i in range(64):
        speculator.observe_step(200 + i % 50, 0.008, sample_s=0.002)
    assert speculator.plain_bound(64) == float("inf")
    assert speculator.plain_bound(200) < float("inf")
    speculator.observe_step(64, 0.002, sample_s=0.001)
    assert 0 < speculator.plain_bound(64) < float("inf")


def _rows(n: int) -> list[ScheduledRow]:
    rows = []
    for i in range(n):
        prompt = [1, 2, 3, 1, 2, 3, 1, 2]
        request = Request(
            f"r{i}",
            prompt,
            SamplingParams(max_tokens=1000, temperature=0.0),
            0.0,
        )
        request.output_token_ids = [3]
        request.num_computed_tokens = len(prompt)
        rows.append(ScheduledRow(request, len(prompt), 1, 1))
    return rows


def test_a_closed_gate_plans_no_drafts_and_lets_the_steps_run_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    speculator = Speculator(SpeculativeConfig(method="ngram", max_draft_len=3), grammar=None, max_model_len=1024)
    for tokens in (1, 4, 16, 64, 1, 4, 16, 64):  # a forward whose tokens are cheap: drafts pay in its eyes
        speculator.observe_step(tokens, (1.0 + 0.01 * tokens) / 1000)
    rows = _rows(4)
    assert [row.num_logits for row in speculator.plan(rows, 512)] == [4, 4, 4, 4]
    assert speculator.drafted and not speculator.may_run_ahead(rows, 0.25)
    assert speculator.gate is not None
    speculator.gate.open = False
    for row in rows:
        row.request.draft_tokens = []
    assert [row.num_logits for row in speculator.plan(rows, 512)] == [1, 1, 1, 1]
    assert not speculator.drafted and speculator.may_run_ahead(rows, 0.25)


@pytest.mark.parametrize(("setting", "gated"), [("open", True), ("closed", True), ("off", False)])
def test_the_gate_follows_its_setting(monkeypatch: pytest.MonkeyPatch, setting: str, gated: bool) -> None:
    monkeypatch.setenv("GUIDESPEC_DRAFT_GATE", setting)
    speculator = Speculator(SpeculativeConfig(method="ngram"), grammar=None, max_model_len=1024)
    assert (speculator.gate is not None) == gated
    if speculator.gate is not None:
        assert speculator.gate.open == (setting == "open")
    fixed = Speculator(SpeculativeConfig(method="ngram", adaptive=False), grammar=None, max_model_len=1024)
    assert fixed.gate is None, "a fixed draft length drafts whatever it costs"


def test_a_batch_at_a_size_whose_drafts_lost_starts_without_them() -> None:
    """The verdict reached at a batch size holds when a batch of that size comes again: 64 rows
    whose drafts lost do not draft for FIRST steps again after a spell of 4 rows (where they win)."""
    gate, host = _drafts_lost_at_64()
    small = _Host(gate, 4, drafting=0.004, plain=0.004, tokens_drafting=10)
    small.now = host.now
    small.run(3 * FIRST)
    assert gate.open, "4 rows: drafts at 2.5 tokens a step for the time of one win"
    host.now, host.modes = small.now, []
    host.run(FIRST)
    assert host.modes.count(True) <= 2, "64 rows again: no drafts (a step of the change-over at most)"
    assert not gate.open
