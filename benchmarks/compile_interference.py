"""What a grammar compile costs the requests it runs beside, and what they cost it.

    python benchmarks/compile_interference.py [--model MODEL] [--values 8000] [--rounds 2]

A compile runs in the background (``docs/architecture.md``: the compile process, its own session
at ``GUIDESPEC_COMPILE_NICE``, default 10). Each round runs one engine per setting, in turn
(so both meet the same moments of a noisy machine): the default, and ``GUIDESPEC_COMPILE_NICE=0``
(the compile at the engine's own priority, as before it was background work). In each engine:

- "alone": an unguided request of 16 greedy tokens on an idle engine (seconds to its end);
- "beside a compile": a guided request whose JSON schema is an enum of ``--values`` new strings
  (seconds of compile: xgrammar 0.2.8, 8,000 values ~2-4 s on 2 cores) is sent, and 0.2 s later
  the same unguided request (seconds to its end), and the guided request's first token (seconds
  from its submission);
- "compile under load": four unguided requests of 200 tokens run, and 0.3 s later a guided
  request with a fresh enum: its first token (seconds from submission), and the four requests'
  wall time, to the last one's end (against the same four alone).

Prints a markdown table (each cell: the rounds' median and range).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import commit, machine, print_rounds_table  # noqa: E402
from guidespec import LLM, SamplingParams  # noqa: E402
from guidespec.protocol import GuidedDecoding  # noqa: E402

SETTINGS = {"background (default)": None, "GUIDESPEC_COMPILE_NICE=0": "0"}
PLAIN = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def _enum(tag: str, values: int) -> GuidedDecoding:
    schema = {"type": "string", "enum": [f"{tag}_value_{i}_{i * 7}" for i in range(values)]}
    return GuidedDecoding(json_schema=schema)


def measure(model: str | None, values: int, tag: str) -> dict[str, float]:
    out: dict[str, float] = {}
    with LLM(model, max_batch_size=8, show_progress=False) as llm:
        llm.generate("Warm up.", SamplingParams(max_tokens=4))
        start = time.perf_counter()
        llm.generate("Count: 1, 2, 3,", PLAIN)
        out["unguided alone"] = time.perf_counter() - start

        async def beside() -> None:
            t0 = time.time()
            guided = asyncio.ensure_future(
                llm.agenerate("Pick one:", SamplingParams(max_tokens=30, temperature=0.0, guided=_enum(tag, values)))
            )
            await asyncio.sleep(0.2)
            t1 = time.perf_counter()
            await llm.agenerate("Count: 1, 2, 3,", PLAIN)
            out["unguided beside a compile"] = time.perf_counter() - t1
            out["guided first token, idle engine"] = (await guided).first_token_time - t0

        async def loaded() -> None:
            t0 = time.time()
            running = [asyncio.ensure_future(llm.agenerate(f"Count {i}: 1, 2,", LONG)) for i in range(4)]
            await asyncio.sleep(0.3)
            t1 = time.time()
            guided = await llm.agenerate(
                "Pick one:", SamplingParams(max_tokens=30, temperature=0.0, guided=_enum(tag + "_load", values))
            )
            out["guided first token, beside 4 requests"] = guided.first_token_time - t1
            done = await asyncio.gather(*running)
            out["4 x 200 tokens beside the compile"] = max(r.finish_time for r in done) - t0

        asyncio.run(beside())
        asyncio.run(loaded())
        start = time.perf_counter()
        llm.generate([f"Count {i}: 1, 2," for i in range(4)], LONG)
        out["4 x 200 tokens alone"] = time.perf_counter() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--values", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name, nice in SETTINGS.items():
            if nice is None:
                os.environ.pop("GUIDESPEC_COMPILE_NICE", None)
            else:
                os.environ["GUIDESPEC_COMPILE_NICE"] = nice
            results[name].append(measure(args.model, args.values, f"r{r}_{os.getpid()}_{len(results[name])}_{nice}"))
            print(f"round {r + 1}, {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in results[name][-1].items()))
    print(f"\n# Compile interference: {args.values}-value enum, {args.rounds} rounds\n")
    print(f"- {time.strftime('%Y-%m-%d')}, commit {commit()}; {machine()}; seconds, median (range) of the rounds")
    print_rounds_table(results, "measure")


if __name__ == "__main__":
    main()
