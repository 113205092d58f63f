"""Guided + speculative decoding on the workload's JME cases: tokens per step for each drafter,
with and without draft-side grammar checks, and tokens/s against guided decoding alone.

    python benchmarks/speculative.py [--cases 10] [--max-tokens 256] [--draft-len 3] [--backend xgrammar]
                                     [--concurrency 16] [--concurrent-cases 32]
                                     [--eagle-head DIR] [--only REGEX] [--repeats N] [--interleave]
                                     [--plot FILE.png] [--phrasings original,rephrased]

Part 1, batch 1 (one request at a time, greedy, draft length fixed at --draft-len): one fresh
engine per configuration serves every case; grammars are compiled before timing. Greedy
speculative output equals plain greedy output, so every configuration computes the same text
(checked) and differs only in steps taken.

With --interleave, part 1 opens every configuration's engine at once and runs each case with
every configuration in turn, so that a machine whose speed drifts over minutes (a shared VM)
slows them alike; a round's time is then the sum of its requests' latencies.

With --phrasings, part 1 runs on each set of prompts named: ``original`` (the workload's
``name is "value";`` lists), ``rephrased`` (the same facts written four other ways by
``benchmarks/rephrase.py``; each style is served by fresh engines, since the styles are the same
records and a drafter's shared pool would learn one's answers from another's), or one style.

Part 2, --concurrency requests at a time over the first --concurrent-cases JME cases (32 by
default, so that 16 are really in flight at once): guided alone, and each drafter with the
adaptive draft length (some also at a fixed length). With the adaptive length, the rows a draft
model or EAGLE head would not pay for draft by prompt lookup (``ngram_fallback``, the default;
one row shows the int8 draft model without it).

Greedy speculative output equals plain greedy output token for token; so does guided alone,
whose jump-forward (the default, verified) drafts the grammar's forced tokens for the model to check.
"tokens/step" = output tokens ÷ target steps that produced them (prefill's last step included);
"tok/s" = output tokens ÷ wall time (prefill included); "decode tok/s" = output tokens after each
request's first ÷ the time after its first token (1 / time per output token, the per-user speed
of TensorRT-LLM's curves; at batch 1 the requests do not overlap);
"time to serve all" = the wall time guided alone takes for the same requests ÷ this configuration's;
"accepted/spec step" = tokens per step that verified drafts (the target's own token included),
TensorRT-LLM's acceptance length. Guided alone already exceeds 1 token/step: its forced tokens
are verified several to a step.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine  # noqa: E402
from benchmarks.rephrase import phrased_groups  # noqa: E402

EAGLE_HEAD = "eagle-head"  # replaced by --eagle-head
NO_JUMP_FORWARD = "no-jump-forward"
BATCH1 = {
    "guided alone (jump-forward)": None,
    "guided alone, no jump-forward (TensorRT-LLM's baseline)": NO_JUMP_FORWARD,
    "grammar-forced drafts only": dict(method="forced"),
    "n-gram, no forced drafts": dict(method="ngram", use_forced_tokens=False),
    "n-gram + forced, drafts unchecked": dict(method="ngram", constrain_drafts=False),
    "n-gram + forced, drafts checked, no anchored lookup": dict(method="ngram", anchored_lookup=False),
    "n-gram + forced, drafts checked": dict(method="ngram"),
    "draft model (first 12 layers), draft steps unmasked": dict(
        method="draft_model", draft_model="layers:12", constrain_drafts=False
    ),
    "draft model (first 12 layers), draft steps masked": dict(method="draft_model", draft_model="layers:12"),
    "draft model = the target itself (acceptance bound)": dict(method="draft_model", draft_model="self"),
    "draft model = the target in int8, draft steps unmasked": dict(
        method="draft_model", draft_model="int8", constrain_drafts=False
    ),
    "draft model = the target in int8, draft steps masked": dict(method="draft_model", draft_model="int8"),
    "EAGLE-3 head (train-eagle), draft steps unmasked": dict(
        method="eagle", draft_model=EAGLE_HEAD, constrain_drafts=False
    ),
    "EAGLE-3 head (train-eagle), draft steps masked": dict(method="eagle", draft_model=EAGLE_HEAD),
    "EAGLE-3 head + n-gram (longer valid draft wins), masked": dict(
        method="eagle", draft_model=EAGLE_HEAD, combine_ngram=True
    ),
    # which draft steps' masks pay (draft_mask_steps): the head alone, always 3 drafts
    **{
        f"EAGLE-3 head, 3 drafts, {label}": dict(
            method="eagle", draft_model=EAGLE_HEAD, adaptive=False, ngram_fallback=False, **options
        )
        for label, options in {
            "every draft step masked": {},
            "first 2 draft steps masked": dict(draft_mask_steps=2),
            "first draft step masked": dict(draft_mask_steps=1),
            "no draft step masked, drafts checked": dict(draft_mask_steps=0),
            "drafts unchecked": dict(constrain_drafts=False),
        }.items()
    },
}
CONCURRENT = {
    "guided alone (jump-forward)": None,
    "n-gram + forced, adaptive length": dict(method="ngram", adaptive=True),
    "n-gram + forced, fixed length": dict(method="ngram", adaptive=False),
    "draft model (first 12 layers), adaptive": dict(method="draft_model", draft_model="layers:12", adaptive=True),
    "draft model = the target in int8, adaptive": dict(method="draft_model", draft_model="int8", adaptive=True),
    "draft model = the target in int8, adaptive, no lookup fallback": dict(
        method="draft_model", draft_model="int8", adaptive=True, ngram_fallback=False
    ),
    "EAGLE-3 head, adaptive": dict(method="eagle", draft_model=EAGLE_HEAD, adaptive=True),
    "EAGLE-3 head, fixed length": dict(method="eagle", draft_model=EAGLE_HEAD, adaptive=False),
    "EAGLE-3 head + n-gram, adaptive": dict(method="eagle", draft_model=EAGLE_HEAD, combine_ngram=True, adaptive=True),
}


def load_cases(n: int) -> list[dict[str, Any]]:
    from guidespec.entrypoints.sweep import default_workload, load_workload

    return load_workload(default_workload(), "JME_", n)


def engine(speculative: dict[str, Any] | str | None, draft_len: int, concurrency: int, backend: str) -> Any:
    from guidespec import LLM

    jump_forward = speculative != NO_JUMP_FORWARD
    if isinstance(speculative, dict):
        speculative = {"max_draft_len": draft_len, "adaptive": False, **speculative}
    else:
        speculative = None
    return LLM(
        max_batch_size=max(concurrency, 2),
        grammar_backend=backend,
        show_progress=False,
        speculative=speculative,
        jump_forward=jump_forward,
    )


def compile_all(llm: Any, cases: list[dict[str, Any]], guided: list[Any]) -> list[int]:
    """Compile every case's grammar first (this measures decoding, not compilation): the usable cases."""
    from guidespec import RequestError, SamplingParams

    usable = []
    for i, case in enumerate(cases):
        try:
            llm.generate(case["messages"], SamplingParams(max_tokens=1, guided=guided[i]))
            usable.append(i)
        except RequestError:
            pass
    return usable


def run(
    groups: list[list[dict[str, Any]]],
    speculative: dict[str, Any] | str | None,
    draft_len: int,
    concurrency: int,
    backend: str,
    max_tokens: int,
) -> dict[str, Any]:
    """Each group of cases served by a fresh engine; the figures over all of them (times summed)."""
    outs: list[Any] = []
    wall = 0.0
    for cases in groups:
        served, seconds = serve(cases, speculative, draft_len, concurrency, backend, max_tokens)
        outs, wall = outs + served, wall + seconds
    return figures(outs, wall)


def serve(
    cases: list[dict[str, Any]],
    speculative: dict[str, Any] | str | None,
    draft_len: int,
    concurrency: int,
    backend: str,
    max_tokens: int,
) -> tuple[list[Any], float]:
    from guidespec import SamplingParams
    from guidespec.protocol import GuidedDecoding

    guided = [GuidedDecoding(json_schema=c["schema"], backend=backend) for c in cases]
    with engine(speculative, draft_len, concurrency, backend) as llm:
        usable = compile_all(llm, cases, guided)
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> Any:
            async with gate:
                return await llm.agenerate(
                    cases[i]["messages"], SamplingParams(max_tokens=max_tokens, temperature=0.0, guided=guided[i])
                )

        async def every() -> list[Any]:
            return list(await asyncio.gather(*(one(i) for i in usable)))

        start = time.perf_counter()
        outs = asyncio.run(every())
        wall = time.perf_counter() - start
    return outs, wall


def interleaved(
    groups: list[list[dict[str, Any]]],
    configs: dict[str, Any],
    repeats: int,
    draft_len: int,
    backend: str,
    max_tokens: int,
) -> dict[str, list[dict[str, Any]]]:
    """Batch 1 with every configuration's engine open at once, each case run by every configuration
    in turn (the order rotating from case to case): a machine whose speed drifts over minutes
    slows every configuration alike. A round's wall time is the sum of its requests' latencies;
    each round has fresh engines (as the rounds of ``run`` do), and so does each group of cases."""
    names = list(configs)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(repeats):  # fresh engines each round: a drafter's public pool must not remember the cases
        outs: dict[str, list[Any]] = {name: [] for name in names}
        for cases in groups:
            for name, served in interleave_group(cases, configs, draft_len, backend, max_tokens).items():
                outs[name] += served
        for name in names:
            result = figures(outs[name], sum(o.latency_s for o in outs[name]))
            rounds[name].append(result)
            print(
                f"batch 1, interleaved, round {r + 1}: {name}: {result['tok_s']:.1f} tok/s, "
                f"{result['tokens_per_step']:.2f} tokens/step",
                flush=True,
            )
    return rounds


def interleave_group(
    cases: list[dict[str, Any]], configs: dict[str, Any], draft_len: int, backend: str, max_tokens: int
) -> dict[str, list[Any]]:
    """One group of cases, each run by every configuration's engine in turn: the outputs by configuration."""
    from contextlib import ExitStack

    from guidespec import SamplingParams
    from guidespec.protocol import GuidedDecoding

    guided = [GuidedDecoding(json_schema=c["schema"], backend=backend) for c in cases]
    names = list(configs)
    with ExitStack() as stack:
        engines = {name: stack.enter_context(engine(configs[name], draft_len, 1, backend)) for name in names}
        usable = sorted(set.intersection(*(set(compile_all(e, cases, guided)) for e in engines.values())))
        outs: dict[str, list[Any]] = {name: [] for name in names}
        for k, i in enumerate(usable):
            for name in names[k % len(names) :] + names[: k % len(names)]:
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, guided=guided[i])
                outs[name].append(engines[name].generate(cases[i]["messages"], params)[0])
    return outs


def figures(outs: list[Any], wall: float) -> dict[str, Any]:
    tokens = sum(len(o.token_ids) for o in outs)
    steps = sum(o.stats.num_steps for o in outs)
    spec_steps = sum(o.stats.num_spec_steps for o in outs)
    accepted = sum(o.stats.num_accepted_tokens for o in outs)
    drafted = sum(o.stats.num_draft_tokens for o in outs)
    histogram: list[int] = []
    for o in outs:
        for n, count in enumerate(o.stats.accepted_histogram):
            histogram.extend([0] * (n + 1 - len(histogram)))
            histogram[n] += count
    decode_s = sum(o.finish_time - o.first_token_time for o in outs)
    return {
        "tok_s": tokens / wall,
        "wall_s": wall,
        "decode_tok_s": (tokens - len(outs)) / decode_s,
        "tokens": tokens,
        "tokens_per_step": tokens / max(steps, 1),
        "accepted_per_spec_step": 1 + accepted / spec_steps if spec_steps else 1.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "histogram": histogram,
        "outputs": [o.token_ids for o in outs],
    }


def table(title: str, rounds: dict[str, list[dict[str, Any]]]) -> str:
    """One row per configuration. With several rounds (--repeats), tok/s is the median over the
    rounds and each ratio the median of the per-round ratios to that round's guided alone, with
    their range; the other columns do not change between rounds (greedy)."""
    base = next(iter(rounds.values()))
    lines = [
        f"\n{title}\n",
        "| configuration | tokens | tokens/step | accepted/spec step | draft acceptance | "
        "steps by drafts accepted | tok/s | ÷ guided alone | decode tok/s | ÷ guided alone, decode | "
        "time to serve all, guided alone ÷ this |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]

    def ratio(runs: list[dict[str, Any]], key: str, inverse: bool = False) -> str:
        values = sorted((b[key] / r[key]) if inverse else (r[key] / b[key]) for r, b in zip(runs, base))
        text = f"{statistics.median(values):.2f}x"
        return text if len(values) == 1 else f"{text} ({values[0]:.2f}–{values[-1]:.2f})"

    for name, runs in rounds.items():
        r = runs[0]
        lines.append(
            f"| {name} | {r['tokens']} | {r['tokens_per_step']:.2f} | {r['accepted_per_spec_step']:.2f} | "
            f"{r['acceptance_rate']:.0%} | {r['histogram']} | "
            f"{statistics.median(x['tok_s'] for x in runs):.1f} | {ratio(runs, 'tok_s')} | "
            f"{statistics.median(x['decode_tok_s'] for x in runs):.1f} | {ratio(runs, 'decode_tok_s')} | "
            f"{ratio(runs, 'wall_s', inverse=True)} |"
        )
    return "\n".join(lines)


def plot_tokens_per_step(rounds: dict[str, list[dict[str, Any]]], path: Path, subtitle: str) -> None:
    """A bar per configuration: tokens per target step, and accepted tokens per speculative step
    (TensorRT-LLM's acceptance length; the target's own token included)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rounds)
    per_step = [rounds[n][0]["tokens_per_step"] for n in names]
    per_spec_step = [rounds[n][0]["accepted_per_spec_step"] for n in names]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.5))
    ys = range(len(names))
    ax.barh([y + 0.2 for y in ys], per_step, height=0.4, label="tokens per step")
    ax.barh([y - 0.2 for y in ys], per_spec_step, height=0.4, label="accepted tokens per speculative step")
    ax.set_yticks(list(ys), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens")
    ax.set_title(f"Tokens per step by drafter ({subtitle})", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 1.2 / (len(names) + 3)), ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--draft-len", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--concurrent-cases",
        type=int,
        default=32,
        help="JME cases for the concurrent part (more than --concurrency, so it is reached)",
    )
    parser.add_argument("--backend", default="xgrammar")
    parser.add_argument("--skip-concurrent", action="store_true")
    parser.add_argument(
        "--phrasings",
        default="original",
        help="batch 1 on these prompts, comma-separated: original (the workload's), rephrased (every style "
        "of benchmarks/rephrase.py, the same facts written other ways), or one style",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds over every configuration (guided alone first in each); ratios are the "
        "median of the per-round ratios, with their range",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="batch 1: every configuration's engine open at once, each case run by all in turn "
        "(ratios robust to a machine whose speed drifts; a round's time is its latencies' sum)",
    )
    parser.add_argument(
        "--eagle-head",
        default=str(Path.home() / ".cache" / "guidespec" / "eagle-smollm2"),
        help="an EAGLE head folder (guidespec train-eagle --output ...)",
    )
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="batch 1: tokens per step per drafter, drawn")
    parser.add_argument(
        "--only",
        default=None,
        metavar="REGEX",
        help="only configurations whose name matches (guided alone always runs: the baseline)",
    )
    args = parser.parse_args()

    def chosen(configs: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for i, (name, spec) in enumerate(configs.items()):
            if i and args.only and not re.search(args.only, name):
                continue
            if isinstance(spec, dict) and spec.get("draft_model") == EAGLE_HEAD:
                if not Path(args.eagle_head).is_dir():
                    print(f"skipping {name!r}: no EAGLE head at {args.eagle_head} (guidespec train-eagle)")
                    continue
                spec = {**spec, "draft_model": args.eagle_head}
            out[name] = spec
        return out

    batch1 = [
        (
            "batch 1" if phrasing == "original" else f"batch 1, {phrasing}",
            chosen(BATCH1),
            1,
            phrased_groups(phrasing, args.cases),
        )
        for phrasing in args.phrasings.split(",")
    ]
    concurrent = (
        f"{args.concurrency} concurrent",
        chosen(CONCURRENT),
        args.concurrency,
        [load_cases(args.concurrent_cases)],
    )
    parts = batch1 + ([] if args.skip_concurrent else [concurrent])
    report = []
    for title, configs, concurrency, groups in parts:
        cases = [case for group in groups for case in group]
        if args.interleave and concurrency == 1:
            rounds = interleaved(groups, configs, args.repeats, args.draft_len, args.backend, args.max_tokens)
        else:
            rounds = {name: [] for name in configs}
            for i in range(args.repeats):
                for name, spec in configs.items():
                    result = run(groups, spec, args.draft_len, concurrency, args.backend, args.max_tokens)
                    rounds[name].append(result)
                    print(
                        f"{title}, round {i + 1}: {name}: {result['tok_s']:.1f} tok/s, "
                        f"{result['tokens_per_step']:.2f} tokens/step",
                        flush=True,
                    )
        if args.plot and concurrency == 1:
            plot_tokens_per_step(
                rounds, Path(args.plot), f"{len(cases)} JME cases, batch 1, greedy, draft length {args.draft_len}"
            )
        speculative = [r["outputs"] for name, runs in rounds.items() if isinstance(configs[name], dict) for r in runs]
        same = all(outputs == speculative[0] for outputs in speculative)
        report.append(
            table(
                f"{title}, {len(cases)} JME cases, greedy, max_tokens {args.max_tokens}, draft length "
                f"{args.draft_len}, {args.backend}; speculative outputs identical token for token: {same}",
                rounds,
            )
        )
    print(f"\n{machine()}")
    print("\n".join(report))


if __name__ == "__main__":
    main()
