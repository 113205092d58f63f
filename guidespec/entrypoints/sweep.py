"""The validity sweep: every case of a JSONSchemaBench-style workload through the engine,
each output validated with ``jsonschema``; a table per category.

    guidespec sweep --backend xgrammar --temperature 0 1

A case counts as: a compile error (the backend refused the schema or timed out); valid
(finished, parses and validates); invalid (finished, and does not parse or does not validate:
an invalid answer reported as a success, which must never happen); cut (ended at
``max_tokens``: reported as ``length``, not as a success); grammar failed (the backend's matcher
gave up mid-way, reported as an error: ``GRAMMAR_FAILED``); a validator error (the ``jsonschema``
library could not judge the output: counted apart, neither valid nor invalid); another error.
Cases run concurrently, as a server would see them. A model without a chat template (a base
model) gets each case as a few-shot completion (``few_shot_prompt``: a worked example from the
workload outside the cases run, then the case), the same text for every case's prompt form.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from decimal import Decimal, localcontext
from pathlib import Path
from typing import Any

from guidespec.protocol import GRAMMAR_FAILED, GuidedDecoding, SamplingParams


@dataclass
class CaseResult:
    case_id: str
    category: str
    # "valid" | "invalid" | "cut" | "compile_error" | "grammar_failed" | "validator_error" | "error" | "skipped"
    status: str
    detail: str
    num_tokens: int
    latency_s: float
    text: str = ""
    accepted_tokens_per_step: float = 1.0


def default_workload() -> Path:
    env = os.environ.get("GUIDESPEC_WORKLOAD")
    if env:
        return Path(env)
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        path = base.parent / "shared" / "data" / "jsonschemabench" / "workload.jsonl"
        if path.exists():
            return path
    raise FileNotFoundError("no workload.jsonl found: pass --workload PATH")


def load_workload(path: Path, prefix: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    cases = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if prefix:
        cases = [c for c in cases if c["id"].startswith(prefix)]
    return cases[:limit]


def few_shot_example(workload: list[dict[str, Any]], run: list[dict[str, Any]]) -> dict[str, Any]:
    """The worked example of a base model's prompts: the first case of the run's first category
    that is not run, else the first case of the workload that is not run."""
    ids = {c["id"] for c in run}
    left = [c for c in workload if c["id"] not in ids and c.get("reference") is not None]
    if not left:
        raise ValueError("a few-shot example needs a workload case with a reference outside the cases run")
    first = category(run[0]["id"]) if run else ""
    return next((c for c in left if category(c["id"]) == first), left[0])


def few_shot_prompt(case: dict[str, Any], example: dict[str, Any]) -> str:
    """A case as a base model's completion: the example's schema, text and answer, then the case's
    schema and text, ending where its JSON starts. The text is the case's last user message."""

    def shot(c: dict[str, Any]) -> str:
        text = [m["content"] for m in c["messages"] if m.get("role") == "user"][-1]
        schema = c["schema"] if isinstance(c["schema"], str) else json.dumps(c["schema"])
        return f"Schema: {schema}\nText: {text}\nJSON:"

    return f"{shot(example)} {json.dumps(example['reference'])}\n\n{shot(case)}"


def category(case_id: str) -> str:
    return case_id.split("---")[0] if "---" in case_id else case_id.rsplit("_", 1)[0]


def validate_output(text: str, schema: Any) -> str | None:
    """None if ``text`` is JSON valid against ``schema``, else why not (or why it could not be
    judged: ``judge_output`` tells the two apart)."""
    verdict, detail = judge_output(text, schema)
    return None if verdict == "valid" else detail


def judge_output(text: str, schema: Any) -> tuple[str, str]:
    """("valid", ""), ("invalid", why) or ("validator_error", why the validator could not judge it:
    an unresolvable ``$ref``, a keyword it fails on: the schema's or the library's fault, not the
    output's). Integers are read exactly (Python ints, whatever their length)."""
    import jsonschema

    try:
        instance = json.loads(text)
    except json.JSONDecodeError as e:
        return "invalid", f"not JSON: {e}"
    try:
        validator_cls = jsonschema.validators.extend(
            jsonschema.validators.validator_for(schema), {"multipleOf": _decimal_multiple_of}
        )
        errors = sorted(validator_cls(schema).iter_errors(instance), key=str)
    except Exception as e:
        return "validator_error", f"cannot validate: {type(e).__name__}: {e}"
    return ("valid", "") if not errors else ("invalid", f"schema violation: {errors[0].message[:200]}")


def _decimal_multiple_of(validator: Any, divisor: Any, instance: Any, schema: Any) -> Any:
    """``multipleOf`` exactly, as JSON numbers are written: jsonschema divides floats, so it finds
    1283.34 not a multiple of 0.01 (1283.34 / 0.01 = 128333.99999999999), and a 167-digit integer
    under ``multipleOf: 3`` raised ``decimal.DivisionImpossible`` (28 digits of precision); the
    backends (llguidance) enforce it on the digits. Integers divide as Python ints; other numbers
    as ``Decimal`` with as many digits as both have."""
    import jsonschema

    if not validator.is_type(instance, "number") or isinstance(instance, bool):
        return
    if isinstance(instance, int) and isinstance(divisor, int):
        remainder_zero = instance % divisor == 0
    else:
        value, step = Decimal(repr(instance)), Decimal(repr(divisor))
        digits = len(value.as_tuple().digits) + len(step.as_tuple().digits)
        exponent = abs(int(value.as_tuple().exponent)) + abs(int(step.as_tuple().exponent))  # type: ignore[arg-type]
        with localcontext() as context:
            context.prec = digits + exponent + 8
            remainder_zero = value % step == 0
    if not remainder_zero:
        yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {divisor!r}")


async def run_cases(
    llm: Any,
    cases: list[dict[str, Any]],
    backend: str,
    temperature: float,
    max_tokens: int,
    concurrency: int,
    seed: int = 0,
    progress: Any = None,
    repetition_penalty: float = 1.0,
    on_result: Any = None,
) -> list[CaseResult]:
    """Every case through ``llm``, ``concurrency`` at a time; ``on_result`` sees each result as it comes."""
    from guidespec.llm import RequestError

    gate = asyncio.Semaphore(concurrency)

    async def one(index: int, case: dict[str, Any]) -> CaseResult:
        guided = GuidedDecoding(json_schema=json.dumps(case["schema"]), backend=backend)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            guided=guided,
            seed=None if temperature == 0 else seed + index,
            repetition_penalty=repetition_penalty,
        )
        async with gate:
            start = time.perf_counter()
            try:
                out = await llm.agenerate(case.get("prompt", case["messages"]), params)
            except ValueError as e:  # the prompt does not fit the model length: not run, said so
                result = CaseResult(case["id"], category(case["id"]), "skipped", str(e)[:300], 0, 0.0)
            except RequestError as e:
                if e.code == GRAMMAR_FAILED:
                    status = "grammar_failed"
                else:
                    status = "compile_error" if is_grammar_refusal(str(e)) else "error"
                result = CaseResult(case["id"], category(case["id"]), status, str(e)[:300], 0, 0.0)
            else:
                latency = time.perf_counter() - start
                if out.finish_reason == "length":
                    status, problem = "cut", "cut at max_tokens"
                else:
                    status, problem = judge_output(out.text, case["schema"])
                result = CaseResult(
                    case["id"],
                    category(case["id"]),
                    status,
                    problem,
                    len(out.token_ids),
                    latency,
                    out.text[:4000],
                    out.stats.mean_accepted_tokens_per_step,
                )
        if progress is not None:
            progress.update(1)
        if on_result is not None:
            on_result(result)
        return result

    return list(await asyncio.gather(*(one(i, c) for i, c in enumerate(cases))))


def is_grammar_refusal(message: str) -> bool:
    """Whether a request's error is its grammar failing to compile (a backend's refusal, or the
    compile timeout), not a failure of the engine."""
    return any(
        s in message
        for s in (
            "xgrammar cannot",
            "llguidance cannot",
            "cannot compile",
            "cannot enforce",
            "grammar compilation",
            "no value can match",
            "additionalProperties: false forbids",
        )
    )


def summarize(results: list[CaseResult], wall_s: float, timed: list[CaseResult] | None = None) -> str:
    """A Markdown table per category; throughput over ``timed`` (the cases run in ``wall_s``)."""
    rows: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in results:
        row = rows[r.category]
        row["cases"] += 1
        row[r.status] += 1
        row["tokens"] += r.num_tokens
        row["latency"] += r.latency_s
    lines = [
        "| category | cases | compiled | compile errors | valid | invalid | cut at max_tokens | grammar failed "
        "| validator errors | other errors | prompt too long | tok/s per request |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    total: dict[str, float] = defaultdict(float)
    for name in sorted(rows):
        row = rows[name]
        for k, v in row.items():
            total[k] += v
        lines.append(_line(name, row))
    lines.append(_line("**all**", total))
    compiled = total["valid"] + total["invalid"]
    valid_pct = 100.0 * total["valid"] / compiled if compiled else 0.0
    lines.append("")
    failures = Counter(failure_reason(r.detail) for r in results if r.status == "grammar_failed")
    if failures:
        lines.append(
            "grammar failures by reason: " + "; ".join(f"{reason} ({n})" for reason, n in failures.most_common())
        )
    throughput = (
        f"; throughput {_tokens(timed if timed is not None else results) / wall_s:.1f} output tok/s over {wall_s:.0f} s"
        if wall_s > 0
        else ""
    )
    lines.append(f"valid among compiled: {int(total['valid'])}/{int(compiled)} = {valid_pct:.1f}%{throughput}")
    speculated = [r for r in results if r.status in ("valid", "invalid")]
    if any(r.accepted_tokens_per_step > 1 for r in speculated):
        mean = sum(r.accepted_tokens_per_step for r in speculated) / len(speculated)
        lines.append(f"mean accepted tokens per speculative step (per request, averaged): {mean:.2f}")
    return "\n".join(lines)


def _tokens(results: list[CaseResult]) -> int:
    return sum(r.num_tokens for r in results)


def failure_reason(detail: str) -> str:
    """A grammar failure's backend and reason, from its message ("llguidance gave up: lexer error: ...")."""
    start = detail.find("(")
    inner = detail[start + 1 :] if start >= 0 else detail
    return inner.split("); ", 1)[0].rstrip(")")


def _line(name: str, row: dict[str, float]) -> str:
    compiled = row["cases"] - row["compile_error"] - row["skipped"]
    rate = row["tokens"] / row["latency"] if row["latency"] else 0.0
    return (
        f"| {name} | {int(row['cases'])} | {int(compiled)} | {int(row['compile_error'])} | {int(row['valid'])} | "
        f"{int(row['invalid'])} | {int(row['cut'])} | {int(row['grammar_failed'])} | {int(row['validator_error'])} "
        f"| {int(row['error'])} | {int(row['skipped'])} | {rate:.1f} |"
    )


def run_sweep(args: Any) -> int:
    """Run the sweep; with ``--results FILE`` each case's result is appended to FILE as it comes,
    and cases FILE already holds for the same configuration are not run again (a sweep can be
    stopped and resumed). The table covers every result of the configuration."""
    from tqdm import tqdm

    from guidespec import LLM
    from guidespec.entrypoints.args import device_from_args, speculative_from_args

    workload = load_workload(Path(args.workload) if args.workload else default_workload())
    cases = load_workload(Path(args.workload) if args.workload else default_workload(), args.prefix, args.limit)
    cases = cases[:: max(1, args.every)]
    speculative = speculative_from_args(args)
    results_path = Path(args.results) if args.results else None
    example: dict[str, Any] = {}  # a base model's few-shot example (``few_shot_example``)
    with contextlib.ExitStack() as stack:
        llm: LLM | None = None  # started once a case is left to run (a finished sweep prints its table alone)
        for temperature in args.temperature:
            config = {
                "backend": args.backend,
                "temperature": temperature,
                "max_tokens": args.max_tokens,
                "repetition_penalty": args.repetition_penalty,
                "speculative": speculative,
            }
            done = _load_results(results_path, config)
            todo = [c for c in cases if c["id"] not in done]
            if todo and llm is None:
                llm = stack.enter_context(
                    LLM(
                        args.model,
                        max_batch_size=args.concurrency,
                        grammar_backend=args.backend,
                        speculative=speculative,
                        grammar_compile_timeout_s=args.compile_timeout,
                        max_model_len=args.max_model_len or _model_limit(args.model),
                        dtype=args.dtype,
                        tensor_parallel_size=args.tensor_parallel_size,
                        enable_prefix_caching=args.enable_prefix_caching,
                        chat_template=args.chat_template,
                        **device_from_args(args),
                    )
                )
                if not llm.prompts.has_chat_template:
                    example = few_shot_example(workload, cases)
                    print(f"no chat template: the cases run as few-shot completions (example {example['id']})")
            if llm is not None and not llm.prompts.has_chat_template:
                todo = [dict(c, prompt=few_shot_prompt(c, example)) for c in todo]
            bar = tqdm(total=len(todo), desc=f"{args.backend} T={temperature:g}", unit="case")
            start = time.perf_counter()
            results = (
                asyncio.run(
                    run_cases(
                        llm,
                        todo,
                        args.backend,
                        temperature,
                        args.max_tokens,
                        args.concurrency,
                        progress=bar,
                        repetition_penalty=args.repetition_penalty,
                        on_result=lambda r: _append_result(results_path, config, r),
                    )
                )
                if llm is not None
                else []
            )
            wall = time.perf_counter() - start
            bar.close()
            ids = {c["id"] for c in cases}
            everything = [r for r in done.values() if r.case_id in ids] + results
            print(
                f"\n### backend {args.backend}, temperature {temperature:g}, max_tokens {args.max_tokens}, "
                f"repetition_penalty {args.repetition_penalty:g}, speculative {speculative}\n"
            )
            print(summarize(everything, wall, results))
            for r in [r for r in everything if r.status in _REPORTED][:40]:
                print(f"  {r.status}: {r.case_id}: {r.detail}")
    return 0


_REPORTED = ("invalid", "grammar_failed", "validator_error", "error")  # listed by case under the table


def _model_limit(model: str | None) -> int:
    """The sweep runs at the model's full length (long prompts are part of the workload)."""
    from guidespec import model_files

    hf_config = model_files.load_hf_config(model_files.resolve_model_dir(model, show_progress=False))
    return int(hf_config.max_position_embeddings)


def print_saved_results(path: Path) -> int:
    """The tables of a ``--results`` file, one per configuration in it, without running anything."""
    by_config: dict[str, list[CaseResult]] = defaultdict(list)
    for line in path.read_text().splitlines():
        record = json.loads(line)
        by_config[json.dumps(record.pop("config"), sort_keys=True)].append(CaseResult(**record))
    for config, results in by_config.items():
        print(f"\n### {config}\n")
        print(summarize(results, wall_s=0.0, timed=[]))
        for r in [r for r in results if r.status in _REPORTED]:
            print(f"  {r.status}: {r.case_id}: {r.detail}")
    return 0


def _load_results(path: Path | None, config: dict[str, Any]) -> dict[str, CaseResult]:
    if path is None or not path.exists():
        return {}
    out: dict[str, CaseResult] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.pop("config") == config:
            out[record["case_id"]] = CaseResult(**record)
    return out


def _append_result(path: Path | None, config: dict[str, Any], result: CaseResult) -> None:
    if path is not None:
        with path.open("a") as f:
            f.write(json.dumps({"config": config, **vars(result)}) + "\n")
