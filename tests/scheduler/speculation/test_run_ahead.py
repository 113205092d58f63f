"""Jump-forward alone and async scheduling: a step with guided rows lets the next one run ahead of
its outputs while forced drafts a row a step are fewer than the share of a step the scheduler's
work in turn takes, and steps in turn where the grammars force more."""

from __future__ import annotations

from guidespec.config import SpeculativeConfig
from guidespec.protocol import GuidedDecoding, SamplingParams
from guidespec.scheduler.batching import ScheduledRow
from guidespec.scheduler.request import Request
from guidespec.scheduler.speculation.proposer import Speculator

HOST = 0.25  # the scheduler's planning and emitting over the rest of a step run in turn


class _Grammars:
    """The grammar owner's one call the plan makes: each request's forced tokens, as set."""

    def __init__(self) -> None:
        self.forced: dict[str, list[int]] = {}

    def forced_tokens(self, request_id: str, limit: int) -> list[int]:
        return self.forced.get(request_id, [])[:limit]


def _rows(n: int, guided: bool = True) -> list[ScheduledRow]:
    rows = []
    for i in range(n):
        prompt = [1, 2, 3]
        guide = GuidedDecoding(regex="[a-z]+") if guided else None
        params = SamplingParams(max_tokens=100, temperature=0.0, guided=guide)
        request = Request(f"r{i}", prompt, params, 0.0)
        request.grammar_ready = True
        request.output_token_ids = [5]
        request.num_computed_tokens = len(prompt)
        rows.append(ScheduledRow(request, len(prompt), 1, 1))
    return rows


def _speculator(grammars: _Grammars, method: str = "forced") -> Speculator:
    return Speculator(SpeculativeConfig(method=method, adaptive=False), grammars, max_model_len=1024, jump_forward=True)


def _learnt(n: int) -> tuple[_Grammars, Speculator, list[ScheduledRow]]:
    """A speculator that has planned 100 steps of ``n`` guided rows whose grammars forced nothing."""
    grammars = _Grammars()
    speculator = _speculator(grammars)
    rows = _rows(n)
    for _ in range(100):
        speculator.plan(rows, max_tokens_per_step=512)
    return grammars, speculator, rows


def test_rows_whose_grammars_force_nothing_run_ahead_after_some_plans() -> None:
    grammars = _Grammars()
    speculator = _speculator(grammars)
    rows = _rows(4)
    assert not speculator.may_run_ahead(rows, HOST)  # (a first document's names are drafted while the rate is learnt)
    plans = 0
    while not speculator.may_run_ahead(rows, HOST):
        speculator.plan(rows, max_tokens_per_step=512)
        plans += 1
    assert 20 <= plans <= 40  # (a long memory: names come in bursts)
    assert speculator.may_run_ahead(_rows(2, guided=False), 0.0)


def test_forced_positions_seen_while_running_ahead_bring_the_steps_back_in_turn() -> None:
    grammars, speculator, rows = _learnt(4)
    for _ in range(20):
        speculator.observe_ahead(rows)  # nothing forced: still ahead
    assert speculator.may_run_ahead(rows, HOST)
    grammars.forced = {"r0": [7, 8], "r1": [9]}  # half the rows at a forced position: 1 draft a row a step in turn
    speculator.observe_ahead(rows)
    assert speculator.may_run_ahead(rows, HOST)  # (once is not enough)
    looks = 1
    while speculator.may_run_ahead(rows, HOST):
        speculator.observe_ahead(rows)
        looks += 1
    assert looks <= 8
    # the plans in turn draft those tokens, and find the rate low again once the names are written
    assert [row.num_logits for row in speculator.plan(rows, max_tokens_per_step=512)] == [3, 2, 1, 1]
    grammars.forced = {}
    for _ in range(40):
        speculator.plan(rows, max_tokens_per_step=512)
    assert speculator.may_run_ahead(rows, HOST)


def test_the_rate_starts_again_when_no_guided_request_is_left() -> None:
    _, speculator, rows = _learnt(2)
    assert speculator.may_run_ahead(rows, HOST)
    speculator.release("r0")
    assert speculator.may_run_ahead(rows, HOST)  # r1 still runs
    speculator.release("r1")
    assert speculator.forced_rate == 1.0 and not speculator.may_run_ahead(rows, HOST)


def test_a_drafter_s_steps_never_run_ahead() -> None:
    speculator = _speculator(_Grammars(), method="ngram")
    assert not speculator.may_run_ahead(_rows(2, guided=False), HOST)
