"""The adaptive draft length: long drafts while they pay, none when acceptance is low or the
forward is compute-bound (large batches), and a probe now and then to notice a change."""

from __future__ import annotations

import numpy as np
import pytest

from guidespec.config import SpeculativeConfig
from guidespec.protocol import GuidedDecoding, SamplingParams
from guidespec.scheduler.batching import ScheduledRow
from guidespec.scheduler.request import Request
from guidespec.scheduler.speculation.proposer import _MODEL_PROBE_EVERY, CostModel, DraftCost, Speculator


def _decoding_rows(n: int) -> list[ScheduledRow]:
    rows = []
    for i in range(n):
        prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # an n-gram drafter always finds "3 1 2" after "1 2"
        request = Request(
            f"r{i}",
            prompt,
            SamplingParams(max_tokens=100, temperature=0.0),
            0.0,
        )
        request.output_token_ids = [3]
        request.num_computed_tokens = len(prompt)
        rows.append(ScheduledRow(request, len(prompt), 1, 1))
    return rows


def _speculator(step_ms: tuple[float, float]) -> Speculator:
    """A speculator whose cost model has seen steps of c0 + c1 * tokens milliseconds."""
    speculator = Speculator(SpeculativeConfig(method="ngram", max_draft_len=3), grammar=None, max_model_len=1024)
    c0, c1 = step_ms
    for tokens in (1, 4, 16, 64, 1, 4, 16, 64):
        speculator.observe_step(tokens, (c0 + c1 * tokens) / 1000)
    return speculator


def _draft_lengths(speculator: Speculator, rows: list[ScheduledRow]) -> list[int]:
    return [row.num_logits - 1 for row in speculator.plan(rows, max_tokens_per_step=512)]


def test_cost_model_recovers_a_linear_step_time() -> None:
    model = CostModel()
    for tokens in (1, 8, 32, 1, 8, 32):
        model.observe(tokens, 0.030 + 0.002 * tokens)
    c0, c1 = model.coefficients()
    assert abs(c0 - 0.030) < 1e-3 and abs(c1 - 0.002) < 1e-4


def test_draft_cost_separates_draft_steps_from_draft_tokens() -> None:
    cost = DraftCost()
    assert cost.coefficients() == (0.0, 0.0) and not cost.seen
    cost.observe(3, 3, 0.030)  # one row, 3 draft steps of 10 ms: all on d0 until rows vary
    assert cost.coefficients() == pytest.approx((0.010, 0.0))
    for steps, drafts in ((3, 27), (2, 8), (1, 1), (3, 12)):
        cost.observe(steps, drafts, 0.008 * steps + 0.001 * drafts)
    d0, d1 = cost.coefficients()
    assert abs(d0 - 0.008) < 1.5e-3 and abs(d1 - 0.001) < 5e-4


def test_full_drafts_when_tokens_are_cheap_and_acceptance_high() -> None:
    speculator = _speculator((30.0, 0.1))  # a memory-bound forward: extra tokens cost little
    rows = _decoding_rows(1)
    assert _draft_lengths(speculator, rows) == [3]
    assert rows[0].request.draft_tokens == [1, 2, 3]


def test_drafts_shrink_when_acceptance_drops_and_probe_later() -> None:
    speculator = _speculator((30.0, 2.0))
    rows = _decoding_rows(1)
    for _ in range(12):  # every draft rejected
        _draft_lengths(speculator, rows)
        speculator.observe(rows[0].request, 3, 0)
    lengths = [_draft_lengths(speculator, rows)[0] for _ in range(16)]
    assert lengths.count(0) >= 12 and 1 in lengths  # off, but probing with one draft now and then


def test_no_drafts_when_the_forward_is_compute_bound_at_a_large_batch() -> None:
    speculator = _speculator((5.0, 4.0))  # each token costs almost as much as a step
    assert sum(_draft_lengths(speculator, _decoding_rows(16))) <= 2
    fixed = Speculator(
        SpeculativeConfig(method="ngram", max_draft_len=3, adaptive=False), grammar=None, max_model_len=1024
    )
    assert _draft_lengths(fixed, _decoding_rows(16)) == [3] * 16


def test_a_draft_model_proposes_one_more_than_the_plan_used() -> None:
    speculator = Speculator(
        SpeculativeConfig(method="draft_model", draft_model="self", max_draft_len=4, ngram_fallback=False),
        grammar=None,
        max_model_len=1024,
    )
    for tokens in (1, 4, 16, 64):
        speculator.observe_step(tokens, (30.0 + 2.0 * tokens) / 1000)  # good drafts would pay here
    rows = _decoding_rows(4)
    proposals = speculator.proposal_lengths(rows)
    assert proposals is not None and proposals[0].tolist() == [0] * 4  # no plan has judged them yet: nothing
    assert _draft_lengths(speculator, rows) == [0] * 4  # (no proposals to draft from yet)
    proposals = speculator.proposal_lengths(rows)
    # planned, but the draft model's cost is unknown: one row proposes (one more than planned) to measure it
    assert proposals is not None and sorted(proposals[0].tolist())[:3] == [0, 0, 0] and max(proposals[0]) >= 2
    speculator.observe_step(4, 0.038, proposed=proposals[0].tolist(), draft_s=0.004)  # cheap: 1 ms per draft step
    _draft_lengths(speculator, rows)
    proposals = speculator.proposal_lengths(rows)
    assert proposals is not None and min(proposals[0].tolist()) >= 2  # now every row
    for _ in range(6):  # their drafts fail: the plan stops drafting for them
        for row in rows:
            speculator.observe(row.request, 3, 0)
    assert _draft_lengths(speculator, rows) == [0] * 4
    seen = []
    for _ in range(2 * _MODEL_PROBE_EVERY):
        speculator.plan(rows, max_tokens_per_step=512)
        proposals = speculator.proposal_lengths(rows)
        assert proposals is not None
        seen.append(proposals[0].tolist())
    # planned 0: nothing proposed (no draft steps paid for), except the step before each probe;
    # the rows probe together, every _MODEL_PROBE_EVERY steps (one catch-up forward for all)
    before_probes = [i for i, p in enumerate(seen) if p == [1] * 4]
    assert len(before_probes) == 2 and before_probes[1] - before_probes[0] == _MODEL_PROBE_EVERY
    after_probes = [i + 1 for i in before_probes]  # the probe step planned 1: its proposals may grow to 2
    assert all(p == [0] * 4 for i, p in enumerate(seen) if i not in before_probes + after_probes)
    # two fruitless probes in a row: the rows stop probing, the draft model never runs for them again
    for _ in range(3 * _MODEL_PROBE_EVERY):
        assert _draft_lengths(speculator, rows) == [0] * 4
        proposals = speculator.proposal_lengths(rows)
        assert proposals is not None and proposals[0].tolist() == [0] * 4


def test_a_costly_drafter_is_turned_off_where_a_cheap_one_drafts() -> None:
    def planned_after_draft_steps_of(ms: float) -> list[int]:
        speculator = Speculator(
            SpeculativeConfig(method="draft_model", draft_model="self", max_draft_len=3, ngram_fallback=False),
            grammar=None,
            max_model_len=1024,
        )
        for tokens in (1, 4, 16, 64, 1, 4, 16, 64):
            speculator.observe_step(tokens, (30.0 + 0.1 * tokens) / 1000)
        speculator.observe_step(1, 0.0301, proposed=[3], draft_s=3 * ms / 1000)
        rows = _decoding_rows(1)
        _draft_lengths(speculator, rows)
        return speculator.proposal_lengths(rows)[0].tolist()  # type: ignore[index]

    assert planned_after_draft_steps_of(1.0) == [3]  # planned 3 (the cap)
    assert planned_after_draft_steps_of(40.0) == [0]  # a draft step costs more than a target step: none


def test_a_prefill_chunk_in_the_step_does_not_make_drafts_look_cheap() -> None:
    """Drafts are judged against a step of the decode rows alone. A 400-token prefill chunk makes
    the step long whatever is drafted; counted in, each draft looked nearly free beside it."""
    speculator = _speculator((5.0, 4.0))  # compute-bound: at 16 rows no draft pays
    rows = _decoding_rows(16)
    assert _draft_lengths(speculator, rows) == [0] * 16
    prompt = list(range(10, 510))
    newcomer = Request(
        "prefill",
        prompt,
        SamplingParams(max_tokens=100, temperature=0.0),
        0.0,
    )
    planned = speculator.plan(rows + [ScheduledRow(newcomer, 0, 400, 0)], max_tokens_per_step=1024)
    assert [row.num_logits - 1 for row in planned[:16]] == [0] * 16
    assert planned[16].num_new_tokens == 400


def test_a_draft_model_stays_idle_where_even_good_drafts_would_not_pay() -> None:
    """16 rows on a compute-bound forward: no draft of any acceptance would raise tokens per second,
    so the draft model never runs for them, not even to start (a first proposal runs it over the
    whole prompt) or to probe."""
    speculator = Speculator(
        SpeculativeConfig(method="draft_model", draft_model="self", max_draft_len=3, ngram_fallback=False),
        grammar=None,
        max_model_len=1024,
    )
    for tokens in (1, 4, 16, 64):
        speculator.observe_step(tokens, (5.0 + 4.0 * tokens) / 1000)
    rows = _decoding_rows(16)
    for _ in range(2 * _MODEL_PROBE_EVERY):
        assert _draft_lengths(speculator, rows) == [0] * 16
        proposals = speculator.proposal_lengths(rows)
        assert proposals is not None and proposals[0].tolist() == [0] * 16


def test_a_new_request_starts_from_what_the_drafter_has_been_worth() -> None:
    """Acceptance learned on earlier requests carries over: after a drafter's drafts kept failing,
    a newcomer is not given full drafts to find that out again."""
    speculator = _speculator((30.0, 2.0))
    assert _draft_lengths(speculator, _decoding_rows(1)) == [3]  # a fresh drafter is trusted
    old = _decoding_rows(4)
    for _ in range(8):  # every draft of earlier requests rejected
        _draft_lengths(speculator, old)
        for row in old:
            speculator.observe(row.request, 3, 0)
    newcomer = _decoding_rows(1)
    newcomer[0].request.request_id = "new"
    assert _draft_lengths(speculator, newcomer) == [0]


def test_a_draft_model_runs_only_for_a_clear_gain() -> None:
    """Near break-even the draft model stays off: its measured cost and the drafts' acceptance are
    estimates, and a plan that expects a few percent is a loss as often as a gain."""

    def lengths_with_draft_cost(ms_per_draft: float) -> list[int]:
        speculator = Speculator(
            SpeculativeConfig(method="draft_model", draft_model="self", max_draft_len=3, ngram_fallback=False),
            grammar=None,
            max_model_len=1024,
        )
        for tokens in (1, 4, 16, 64, 1, 4, 16, 64):
            speculator.observe_step(tokens, (30.0 + 0.1 * tokens) / 1000)
        speculator.observe_step(1, 0.0301, proposed=[1], draft_s=ms_per_draft / 1000)
        rows = _decoding_rows(1)
        _draft_lengths(speculator, rows)  # the request's first plan
        return [p for p in speculator.proposal_lengths(rows)[0].tolist()]  # type: ignore[index]

    assert lengths_with_draft_cost(3.0) == [3]  # cheap drafts: a large gain
    assert lengths_with_draft_cost(17.0) == [0]  # +8% expected at best: not worth it


def _model_speculator(draft_ms: float, fallback: bool) -> Speculator:
    """A draft-model speculator on a memory-bound forward whose draft steps cost ``draft_ms`` each."""
    speculator = Speculator(
        SpeculativeConfig(method="draft_model", draft_model="self", max_draft_len=3, ngram_fallback=fallback),
        grammar=None,
        max_model_len=1024,
    )
    for tokens in (1, 4, 16, 64, 1, 4, 16, 64):
        speculator.observe_step(tokens, (30.0 + 0.1 * tokens) / 1000)
    speculator.observe_step(1, 0.0301, proposed=[3], draft_s=3 * draft_ms / 1000)
    return speculator


def test_where_a_draft_model_does_not_pay_prompt_lookup_drafts_instead() -> None:
    """A draft step dearer than a target step: the draft model stays off, and the rows draft by
    prompt lookup (no proposing cost) with acceptance figures of its own; without the fallback,
    they draft nothing."""
    rows = _decoding_rows(4)
    alone = _model_speculator(40.0, fallback=False)
    assert _draft_lengths(alone, rows) == [0] * 4
    speculator = _model_speculator(40.0, fallback=True)
    assert _draft_lengths(speculator, rows) == [3] * 4
    assert all(row.request.draft_tokens == [1, 2, 3] for row in rows)  # lookup's: "3 1 2" follows "1 2" ... "3"
    proposals = speculator.proposal_lengths(rows)
    assert proposals is not None and proposals[0].tolist() == [0] * 4  # the draft model does not run for them
    for _ in range(6):  # lookup's drafts fail: lookup's figures fall, the draft model's are untouched
        for row in rows:
            speculator.observe(row.request, 3, 0)
        _draft_lengths(speculator, rows)
    assert max(_draft_lengths(speculator, rows)) <= 1  # (a draft costs little on this memory-bound forward)
    assert all(speculator.lookup_acceptance[row.request.request_id].rate < 0.2 for row in rows)
    assert all(speculator.acceptance[row.request.request_id].rate == pytest.approx(0.7) for row in rows)


def test_a_draft_model_that_pays_is_not_replaced_by_lookup() -> None:
    """Cheap draft steps: the draft model drafts, as without the fallback."""
    rows = _decoding_rows(1)
    speculator = _model_speculator(1.0, fallback=True)
    _draft_lengths(speculator, rows)
    proposals = speculator.proposal_lengths(rows)
    assert proposals is not None and proposals[0].tolist() == [3]
    assert not speculator._lookup_drafted


@pytest.mark.parametrize("mask_steps", [None, 0, 1, 5])
def test_a_guided_rows_first_draft_steps_are_masked(mask_steps: int | None) -> None:
    """``draft_mask_steps``: how many of a guided row's proposed drafts wait for its grammar's
    mask (rank 0 asks the scheduler for those alone); unguided rows never wait."""
    config = SpeculativeConfig(
        method="draft_model", draft_model="self", max_draft_len=3, adaptive=False, draft_mask_steps=mask_steps
    )
    speculator = Speculator(config, grammar=None, max_model_len=1024)
    rows = _decoding_rows(2)
    rows[0].request.params = SamplingParams(max_tokens=100, temperature=0.0, guided=GuidedDecoding(regex="[ab]+"))
    proposals = speculator.proposal_lengths(rows)
    assert proposals is not None and proposals[0].tolist() == [3, 3]
    expected = 3 if mask_steps is None else min(3, mask_steps)
    assert proposals[1].dtype == np.int32 and proposals[1].tolist() == [expected, 0]


def test_draft_mask_steps_must_be_a_small_count() -> None:
    for bad in (-1, 17, 1.5, True):
        with pytest.raises(ValueError, match="draft_mask_steps"):
            SpeculativeConfig(method="eagle", draft_model="x", draft_mask_steps=bad).validate()  # type: ignore[arg-type]
