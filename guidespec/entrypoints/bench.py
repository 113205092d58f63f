"""``guidespec bench``: a load generator, in-process or against a server URL.

For each configuration (``unguided``, ``guided``, ``guided+spec``) and each concurrency level it
sends ``--num-prompts`` requests, at most ``concurrency`` in flight, and measures per request the
time to first token (TTFT), the time per output token after the first (TPOT), the output tokens,
the tokens per speculative step and, for guided requests, whether the output validates against
the case's schema. Per (configuration, concurrency): total output tokens/s, per-user tokens/s
(each request's output tokens ÷ its latency, averaged), TTFT and TPOT p50/p99, accepted tokens
per step, validity. Writes ``bench.json``, ``bench.md`` (a Markdown table) and ``bench.png``:
per-user vs total tokens/s, one curve per configuration, points labelled by concurrency (the
Pareto view of the TensorRT-LLM blog's figures).

Prompts: the data set's ``workload.jsonl`` (chat prompts with a JSON schema each; ``unguided``
sends the same prompts without the schema) or ``--synthetic`` prompts of ``--input-len`` tokens.
In-process, one engine (with ``--speculative``, default ngram) serves every configuration; the
configurations without speculation turn it off per request, as against a server (the
``speculative`` request field).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import numpy as np

CONFIGS = ("unguided", "guided", "guided+spec")


@dataclass
class Result:
    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    accepted_per_step: float = 1.0
    valid: bool | None = None  # guided requests: does the output validate
    error: str = ""

    @property
    def tpot_s(self) -> float:
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass
class Level:
    config: str
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    output_tokens: int
    total_tok_s: float
    per_user_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    accepted_per_step: float
    valid_fraction: float | None
    error_samples: list[str] = field(default_factory=list)


@dataclass
class Case:
    messages: Any  # chat messages, or a plain prompt string
    schema: Any | None


Submit = Callable[[Case, str, int], Awaitable[Result]]


def load_cases(workload: Path | None, num: int, synthetic: bool, input_len: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    if synthetic:
        words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
        return [
            Case(
                [
                    {
                        "role": "user",
                        "content": " ".join(rng.choice(words) for _ in range(input_len))
                        + "\nDescribe these words as a JSON object.",
                    }
                ],
                {"type": "object"},
            )
            for _ in range(num)
        ]
    from guidespec.entrypoints.sweep import default_workload, load_workload

    cases = load_workload(workload or default_workload())
    rng.shuffle(cases)
    return [Case(c["messages"], c["schema"]) for c in cases[:num]]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q, method="nearest")) if values else 0.0


async def run_level(
    submit: Submit, cases: list[Case], config: str, concurrency: int, max_tokens: int, progress: Any = None
) -> Level:
    gate = asyncio.Semaphore(concurrency)

    async def one(case: Case) -> Result:
        async with gate:
            try:
                return await submit(case, config, max_tokens)
            except Exception as e:  # a refused case counts as an error, the run goes on
                return Result(False, error=f"{type(e).__name__}: {e}"[:300])
            finally:
                if progress is not None:
                    progress.update(1)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(c) for c in cases))
    wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    checked = [r.valid for r in ok if r.valid is not None]
    return Level(
        config,
        concurrency,
        len(results),
        len(results) - len(ok),
        wall,
        tokens,
        tokens / wall if wall else 0.0,
        statistics.fmean(r.output_tokens / r.latency_s for r in ok if r.latency_s > 0) if ok else 0.0,
        percentile([r.ttft_s for r in ok], 50),
        percentile([r.ttft_s for r in ok], 99),
        percentile([r.tpot_s for r in ok if r.output_tokens > 1], 50),
        percentile([r.tpot_s for r in ok if r.output_tokens > 1], 99),
        statistics.fmean(r.accepted_per_step for r in ok) if ok else 0.0,
        sum(checked) / len(checked) if checked else None,
        [r.error for r in results if not r.ok][:3],
    )


def _validate(text: str, schema: Any) -> bool:
    from guidespec.entrypoints.sweep import validate_output

    return validate_output(text, schema) is None


def in_process_submit(llm: Any) -> Submit:
    from guidespec import SamplingParams
    from guidespec.protocol import GuidedDecoding

    async def submit(case: Case, config: str, max_tokens: int) -> Result:
        guided = GuidedDecoding(json_schema=case.schema) if config != "unguided" and case.schema is not None else None
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, guided=guided, speculative=config == "guided+spec"
        )
        handle = llm.open_stream(case.messages, params)
        async for _ in handle.deltas():
            pass
        out = handle.output
        return Result(
            True,
            out.time_to_first_token_s,
            out.latency_s,
            len(out.token_ids),
            out.stats.mean_accepted_tokens_per_step,
            _validate(out.text, case.schema) if guided is not None else None,
        )

    return submit


def url_submit(url: str, model: str | None, api_key: str | None) -> Submit:
    import httpx

    client = httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})

    async def submit(case: Case, config: str, max_tokens: int) -> Result:
        body: dict[str, Any] = {
            "messages": case.messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "speculative": config == "guided+spec",
        }
        if model:
            body["model"] = model
        guided = config != "unguided" and case.schema is not None
        if guided:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "case", "schema": case.schema}}
        start = time.perf_counter()
        first = 0.0
        text, usage = "", {}
        async with client.stream("POST", f"{url.rstrip('/')}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                return Result(False, error=f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(False, error=str(chunk["error"].get("message")))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    piece = choice.get("delta", {}).get("content") or ""
                    if piece and not first:
                        first = time.perf_counter() - start
                    text += piece
        latency = time.perf_counter() - start
        return Result(
            True,
            first,
            latency,
            int(usage.get("completion_tokens", 0)),
            float(usage.get("accepted_tokens_per_step", 1.0)),
            _validate(text, case.schema) if guided else None,
        )

    return submit


def markdown(levels: list[Level]) -> str:
    lines = [
        "| configuration | concurrency | requests | errors | output tok/s | per-user tok/s | TTFT p50 / p99 (s) "
        "| TPOT p50 / p99 (ms) | accepted/spec step | valid |",
        "|---|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for lv in levels:
        valid = "—" if lv.valid_fraction is None else f"{lv.valid_fraction:.0%}"
        lines.append(
            f"| {lv.config} | {lv.concurrency} | {lv.requests} | {lv.errors} | {lv.total_tok_s:.1f} | "
            f"{lv.per_user_tok_s:.1f} | {lv.ttft_p50_s:.2f} / {lv.ttft_p99_s:.2f} | "
            f"{lv.tpot_p50_s * 1000:.0f} / {lv.tpot_p99_s * 1000:.0f} | {lv.accepted_per_step:.2f} | {valid} |"
        )
    return "\n".join(lines)


def plot(levels: list[Level], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for config in dict.fromkeys(lv.config for lv in levels):
        points = sorted((lv for lv in levels if lv.config == config), key=lambda lv: lv.concurrency)
        ax.plot([p.per_user_tok_s for p in points], [p.total_tok_s for p in points], marker="o", label=config)
        for p in points:
            ax.annotate(
                str(p.concurrency),
                (p.per_user_tok_s, p.total_tok_s),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
    ax.set_xlabel("per-user output tokens/s")
    ax.set_ylabel("total output tokens/s")
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench(args: Any) -> int:
    from tqdm import tqdm

    from guidespec.entrypoints.args import device_from_args, speculative_from_args

    configs = args.configs
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; choose among {', '.join(CONFIGS)}")
    cases = load_cases(
        Path(args.workload) if args.workload else None, args.num_prompts, args.synthetic, args.input_len, args.seed
    )
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    total = len(configs) * len(args.concurrency) * len(cases)
    levels: list[Level] = []

    async def sweep(submit: Submit) -> None:
        with tqdm(total=total, desc="guidespec bench", unit="req") as bar:
            for config in configs:
                for concurrency in args.concurrency:
                    bar.set_postfix(config=config, concurrency=concurrency)
                    levels.append(await run_level(submit, cases, config, concurrency, args.max_tokens, bar))

    if args.url:
        asyncio.run(sweep(url_submit(args.url, args.served_model_name, args.api_key)))
        where = args.url
    else:
        from guidespec import LLM

        speculative = speculative_from_args(args) or {"method": "ngram"}
        with LLM(
            args.model,
            tensor_parallel_size=args.tensor_parallel_size,
            dtype=args.dtype,
            max_batch_size=max(args.max_batch_size, max(args.concurrency)),
            max_model_len=args.max_model_len,
            grammar_backend=args.backend,
            speculative=speculative,
            show_progress=False,
            distributed_executor=args.distributed_executor,
            ray_address=args.ray_address,
            enable_prefix_caching=args.enable_prefix_caching,
            chat_template=args.chat_template,
            **device_from_args(args),
        ) as llm:
            fitting = [
                c for c in cases if len(llm.encode_prompt(c.messages)) + args.max_tokens <= llm.config.max_model_len
            ]
            if len(fitting) < len(cases):
                print(
                    f"guidespec bench: {len(cases) - len(fitting)} of {len(cases)} prompts leave no room for "
                    f"{args.max_tokens} tokens in the model length {llm.config.max_model_len}: left out"
                )
                cases[:] = fitting
                total = len(configs) * len(args.concurrency) * len(cases)
            asyncio.run(sweep(in_process_submit(llm)))
        where = f"in-process, speculative {speculative['method']}"
    title = (
        f"guidespec bench: {len(cases)} {'synthetic' if args.synthetic else 'workload'} prompts, "
        f"max_tokens {args.max_tokens}, greedy ({where})"
    )
    table = markdown(levels)
    (out_dir / "bench.json").write_text(json.dumps({"title": title, "levels": [asdict(lv) for lv in levels]}, indent=2))
    (out_dir / "bench.md").write_text(f"{title}\n\n{table}\n")
    plot(levels, out_dir / "bench.png", title)
    print(f"{title}\n\n{table}\n\nwrote {out_dir / 'bench.json'}, {out_dir / 'bench.md'}, {out_dir / 'bench.png'}")
    return 0 if all(lv.errors < lv.requests for lv in levels) else 1
