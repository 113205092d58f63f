"""Guided vs unguided throughput, and the scheduler's cost per step, on the workload's JME cases.

    python benchmarks/guided.py [--cases 16] [--max-tokens 256] [--repeats 3] [--trace-dir out/]

For each backend (xgrammar, llguidance) and each concurrency (1 and 16), one engine serves
the JME chat prompts greedily under each case's JSON schema; then a fresh engine serves the same
prompts unguided, each request held to exactly the number of tokens its guided twin produced
(EOS ignored), so both runs compute the same tokens and differ only by guidance. Reported:
output tokens/s, guided ÷ unguided, and from the
scheduler's step trace the fraction of step time spent in scheduler work outside the forward
(goal <= 5% at 16) and the mean mask-fill time. A Chrome trace per run is written to
--trace-dir (open in chrome://tracing or ui.perfetto.dev).

With ``--repeats N`` each pair runs N times, guided and unguided alternating, and the table gives
the median of the N ratios with their range: on a shared 2-core machine one pair's ratio at 16
concurrent moved between 0.91 and 1.24 from one run to the next.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine  # noqa: E402


def load_cases(n: int) -> list[dict]:
    from guidespec.entrypoints.sweep import default_workload, load_workload

    return load_workload(default_workload(), "JME_", n)


def run(
    backend: str, guided: bool, cases: list[dict], concurrency: int, lengths: list[int], trace: Path
) -> tuple[dict[str, float], list[int]]:
    """Serve every case; guided with ``lengths`` as max_tokens, or unguided held to exactly ``lengths``."""
    from guidespec import LLM, RequestError, SamplingParams
    from guidespec.protocol import GuidedDecoding

    def params(i: int) -> SamplingParams:
        if guided:
            return SamplingParams(
                max_tokens=lengths[i],
                temperature=0.0,
                guided=GuidedDecoding(json_schema=cases[i]["schema"], backend=backend),
            )
        return SamplingParams(max_tokens=max(1, lengths[i]), temperature=0.0, ignore_eos=True)

    os.environ["GUIDESPEC_TRACE"] = str(trace)
    with LLM(max_batch_size=max(concurrency, 2), grammar_backend=backend, show_progress=False) as llm:
        if guided:  # compile every grammar first: this measures decoding, not compilation
            for i, case in enumerate(cases):
                try:
                    llm.generate(case["messages"], SamplingParams(max_tokens=1, guided=params(i).guided))
                except RequestError:
                    pass
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> int:
            if not guided and lengths[i] == 0:
                return 0  # its guided twin failed to compile
            async with gate:
                try:
                    return len((await llm.agenerate(cases[i]["messages"], params(i))).token_ids)
                except RequestError:
                    return 0

        async def all_cases() -> list[int]:
            return list(await asyncio.gather(*(one(i) for i in range(len(cases)))))

        start = time.perf_counter()
        counts = asyncio.run(all_cases())
        wall = time.perf_counter() - start
    del os.environ["GUIDESPEC_TRACE"]
    summary = json.loads(trace.read_text())["summary"]
    return {"tok_s": sum(counts) / wall, "tokens": sum(counts), **summary}, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance"])
    parser.add_argument("--trace-dir", type=Path, default=Path("out"))
    parser.add_argument("--repeats", type=int, default=1, help="runs per pair; the table gives the median ratio")
    args = parser.parse_args()
    args.trace_dir.mkdir(parents=True, exist_ok=True)
    cases = load_cases(args.cases)
    rows = []
    for concurrency in args.concurrency:
        for backend in args.backends:
            pairs = []
            for repeat in range(args.repeats):
                guided, lengths = run(
                    backend,
                    True,
                    cases,
                    concurrency,
                    [args.max_tokens] * len(cases),
                    args.trace_dir / f"trace-{backend}-c{concurrency}.json",
                )
                unguided, counts = run(
                    backend,
                    False,
                    cases,
                    concurrency,
                    lengths,
                    args.trace_dir / f"trace-unguided-like-{backend}-c{concurrency}.json",
                )
                assert counts == lengths, (counts, lengths)
                pairs.append((guided, unguided))
                print(
                    f"{backend} c={concurrency} run {repeat + 1}: guided {guided['tok_s']:.1f} tok/s, unguided "
                    f"{unguided['tok_s']:.1f} tok/s ({sum(lengths)} tokens each)",
                    flush=True,
                )
            pairs.sort(key=lambda p: p[0]["tok_s"] / p[1]["tok_s"])
            ratios = [g["tok_s"] / u["tok_s"] for g, u in pairs]
            rows.append((backend, concurrency, *pairs[len(pairs) // 2], min(ratios), max(ratios)))
    print(
        f"\n{machine()}; {len(cases)} JME cases, greedy, max_tokens {args.max_tokens}, "
        f"{args.repeats} run(s) per pair (the median pair shown)\n"
    )
    print(
        "| backend | concurrency | tokens | guided tok/s | unguided tok/s | guided ÷ unguided | range over runs | "
        "scheduler outside forward (guided / unguided) | mean mask fill ms | mean step ms (guided / unguided) |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for backend, concurrency, g, u, low, high in rows:
        print(
            f"| {backend} | {concurrency} | {int(g['tokens'])} | {g['tok_s']:.1f} | {u['tok_s']:.1f} | "
            f"{g['tok_s'] / u['tok_s']:.3f} | {low:.3f}–{high:.3f} | "
            f"{g['outside_forward_fraction']:.1%} / {u['outside_forward_fraction']:.1%} | "
            f"{g['mean_fill_ms']:.2f} | {g['mean_step_ms']:.1f} / {u['mean_step_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
