"""The validity sweep (``guidespec sweep``): its judgement of outputs, and a bounded slice of the
whole sweep of ``docs/benchmarks.md`` (every 94th workload case, both backends, greedy and T=1,
n-gram drafts), where no invalid output may be reported as a success."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from guidespec.entrypoints.sweep import (
    CaseResult,
    default_workload,
    few_shot_example,
    few_shot_prompt,
    judge_output,
    load_workload,
    run_cases,
    validate_output,
)


def test_big_integers_are_judged_exactly() -> None:
    """A 167-digit integer under multipleOf 3 (a valid answer) raised decimal.DivisionImpossible,
    and the sweep called the output invalid."""
    schema = {"type": "integer", "multipleOf": 3}
    assert judge_output("9" * 167, schema) == ("valid", "")
    verdict, detail = judge_output("9" * 166 + "8", schema)
    assert verdict == "invalid" and "is not a multiple of 3" in detail
    assert judge_output("1" + "0" * 80 + ".5", {"multipleOf": 0.5}) == ("valid", "")


def test_a_validator_failure_is_not_an_invalid_output() -> None:
    verdict, detail = judge_output('{"a": 1}', {"$ref": "#/definitions/missing"})
    assert verdict == "validator_error" and detail.startswith("cannot validate")
    assert judge_output("{", {"type": "object"})[0] == "invalid"
    assert validate_output('{"a": 1}', {"type": "object"}) is None


# cases the whole sweep found wrong once: llguidance + n-gram, greedy, answered "the grammar
# rejected sampled token" (its mask cache outlived a rollback: test_rollback_masks.py)
FOUND_BY_THE_SWEEP = ("JME_60", "Glaiveai2K---generate_invoice_214a7c51")


@pytest.mark.slow
def test_a_base_models_prompt_is_a_worked_example_then_the_case() -> None:
    """A model without a chat template gets each case as a few-shot completion: an example from
    outside the run (its category first), then the case's own schema and text, ending at "JSON:"."""
    workload = load_workload(default_workload())
    run = load_workload(default_workload(), "JME_", 5)
    example = few_shot_example(workload, run)
    assert example["id"].startswith("JME_") and example["id"] not in {c["id"] for c in run}
    for case in run:
        prompt = few_shot_prompt(case, example)
        head, _, tail = prompt.partition("\n\n")
        user = [m["content"] for m in case["messages"] if m["role"] == "user"][-1]
        assert tail.endswith(f"Text: {user}\nJSON:") and json.dumps(case["schema"]) in tail
        answer = head.rpartition("JSON: ")[2]
        assert json.loads(answer) == example["reference"] and validate_output(answer, example["schema"]) is None
    with pytest.raises(ValueError, match="outside the cases run"):
        few_shot_example(run, run)


def test_a_slice_of_the_sweep_reports_no_invalid_output_as_a_success() -> None:
    from guidespec import LLM

    try:
        workload = default_workload()
    except FileNotFoundError:
        pytest.skip("the shared data set is not beside this checkout")
    everything = load_workload(workload)
    cases = everything[::94] + [c for c in everything if c["id"] in FOUND_BY_THE_SWEEP]
    passes = [(backend, temperature) for backend in ("xgrammar", "llguidance") for temperature in (0.0, 1.0)]

    async def sweep(llm: LLM) -> list[list[CaseResult]]:
        """The four passes at once, one load on the engine: a pass's longest case no longer holds
        the next pass back (the cases the sweep found failed greedy: those passes only)."""
        runs = [
            run_cases(
                llm, cases if t == 0.0 else cases[: -len(FOUND_BY_THE_SWEEP)], b, t, max_tokens=192, concurrency=8
            )
            for b, t in passes
        ]
        return list(await asyncio.gather(*runs))

    counts: Counter[str] = Counter()
    with LLM(max_batch_size=8, speculative="ngram", show_progress=False) as llm:
        results = asyncio.run(sweep(llm))
    for (backend, temperature), results_of_pass in zip(passes, results):
        for r in results_of_pass:
            counts[r.status] += 1
            assert r.status != "invalid", (backend, temperature, r.case_id, r.detail, r.text)
            assert r.status != "error", (backend, temperature, r.case_id, r.detail)
            if r.status == "grammar_failed":  # surfaced as an error that names the backend
                assert f"{backend} gave up" in r.detail
    assert counts["valid"] >= 0.6 * sum(counts.values()), counts
