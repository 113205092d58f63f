"""Drafters replayed offline on the JME cases' greedy outputs: tokens per step without the model.

    python benchmarks/replay_drafters.py [--cases 10] [--max-tokens 256] [--draft-len 3]
                                         [--phrasings original,rephrased] [--outputs DIR]

Greedy speculative output equals plain greedy output, so how many tokens each step of a drafter
yields follows from the greedy outputs and the grammar alone. The script generates the greedy
outputs once with the engine (kept in ``--outputs``), then replays each request step by step as
the scheduler runs it: the grammar's forced tokens first (accepted as far as they match), then
the drafter's up to ``--draft-len`` tokens after them, cut where the grammar rejects them,
accepted as far as they match the output, plus the target's own token. Rows: perfect drafts (the
bound at this draft length), prompt lookup without and with the anchored lookup; columns: the
prefill step yields one token and every token takes a step (the engine before), a complete output
ends without a step (the scheduler's ``end_token``: the replay ends an output there when only the
stop token is left, as xgrammar allows nothing else after a JSON value), and also the prefill step
verifies drafts (the engine now). The replays matched the engine's tokens per step.

``--phrasings`` picks the prompts: ``original`` (the workload's ``name is "value";`` lists),
``rephrased`` (every style of ``benchmarks/rephrase.py``: the same facts written as sentences,
``key: value`` lines, shuffled quoted values and prose), or one style by name; each gets its
greedy outputs and its table, then one table gives each drafter's figure (the engine now) on each.
Each style is replayed with a drafter of its own: they are the same records, and a drafter's
shared pool would otherwise learn one style's answers from another's.
Grammars compile as the engine's ``auto`` backend does: xgrammar, else llguidance where xgrammar
refuses the schema.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

Propose = Callable[[list[int], int, Callable[[Sequence[int]], int]], list[int]]


def greedy_outputs(path: Path, cases: list[dict[str, Any]], max_tokens: int) -> list[dict[str, Any]]:
    """The greedy outputs of ``cases`` (generated once, kept in ``path``)."""
    ids = [case["id"] for case in cases]
    if path.exists():
        data = json.loads(path.read_text())
        if data.get("ids") == ids and data["max_tokens"] == max_tokens:
            return list(data["outputs"])
    from guidespec import LLM, RequestError, SamplingParams
    from guidespec.protocol import GuidedDecoding

    outputs = []
    with LLM(show_progress=False, speculative=dict(method="ngram", adaptive=False)) as llm:
        for case in cases:
            try:
                out = llm.generate(
                    case["messages"],
                    SamplingParams(
                        max_tokens=max_tokens, temperature=0.0, guided=GuidedDecoding(json_schema=case["schema"])
                    ),
                )[0]
            except RequestError:
                continue  # a schema the backends refuse
            outputs.append(
                dict(
                    id=case["id"],
                    schema=case["schema"],
                    prompt=list(map(int, out.prompt_token_ids)),
                    output=list(map(int, out.token_ids)),
                )
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(ids=ids, max_tokens=max_tokens, outputs=outputs)))
    return outputs


def matchers(tokenizer: Any, stop: int, outputs: list[dict[str, Any]]) -> list[Callable[[], Any]]:
    """A fresh matcher for each output's schema, compiled as the engine's ``auto`` backend does
    (the schema's exact rewrites first)."""
    from guidespec.grammar_backends import GrammarError, create_backend
    from guidespec.grammar_backends.rewrites import rewrite_schema
    from guidespec.protocol import AUTO_BACKEND_ORDER, GuidedDecoding

    backends = [create_backend(name, tokenizer, len(tokenizer), (stop,)) for name in AUTO_BACKEND_ORDER]
    made = []
    for case in outputs:
        spec = GuidedDecoding(json_schema=json.dumps(rewrite_schema(case["schema"])[0]))
        for backend in backends:
            try:
                compiled = backend.compile(spec)
            except GrammarError:
                continue
            made.append(functools.partial(backend.create_matcher, compiled))
            break
        else:
            raise GrammarError(f"no backend compiles {case.get('id')}")
    return made


def replay(
    outputs: list[dict[str, Any]],
    new_matchers: list[Callable[[], Any]],
    make: Callable[[], Propose] | None,
    draft_len: int,
    end_without_step: bool,
    stop: int,
    prefill_drafts: bool = False,
) -> tuple[int, int]:
    """Tokens and steps of one drafter (``make``: a new request's propose; None: perfect drafts)."""
    tokens = steps = 0
    for case, new_matcher in zip(outputs, new_matchers):
        matcher = new_matcher()
        propose = make() if make is not None else None
        prompt, out = case["prompt"], case["output"]
        pos = 0
        while pos < len(out):
            if end_without_step and pos and out[pos:] == [stop]:
                break
            if pos == 0 and not prefill_drafts:
                produced = 1  # the prefill step
            else:
                forced = matcher.forced_tokens(16)
                same = 0
                while same < len(forced) and pos + same < len(out) and out[pos + same] == forced[same]:
                    same += 1
                if same < len(forced):
                    produced = same + 1
                else:
                    base = pos + same

                    def valid_prefix(drafts: Sequence[int]) -> int:
                        for t in forced:
                            matcher.accept_token(t)
                        count = 0
                        for t in drafts:
                            if matcher.is_terminated() or not matcher.accept_token(int(t)):
                                break
                            count += 1
                        matcher.rollback(len(forced) + count)
                        return count

                    drafts = (
                        out[base : base + draft_len]
                        if propose is None
                        else propose(prompt + out[:base], len(prompt) + pos, valid_prefix)
                    )
                    hit = 0
                    while hit < len(drafts) and base + hit < len(out) and out[base + hit] == drafts[hit]:
                        hit += 1
                    produced = same + hit + 1
            for t in out[pos : pos + produced]:
                matcher.accept_token(t)
            pos += produced
            steps += 1
        tokens += len(out)
    return tokens, steps


def tokens_per_step(
    outputs: list[dict[str, Any]],
    new_matchers: list[Callable[[], Any]],
    kind: str,
    tokenizer: Any,
    draft_len: int,
    modes: tuple[bool, bool, int],
) -> float:
    """Tokens per step of drafter ``kind`` over ``outputs``, with a drafter of its own for each style
    of phrasing (the rephrased styles are the same records: a shared pool must not learn one
    style's answers from another's). ``modes``: a complete output ends without a step, drafts in
    the prefill step, the stop token."""
    end, prefill, stop = modes
    tokens = steps = 0
    for style in dict.fromkeys(case["id"].partition("~")[2] for case in outputs):
        chosen = [i for i, case in enumerate(outputs) if case["id"].partition("~")[2] == style]
        counts = replay(
            [outputs[i] for i in chosen],
            [new_matchers[i] for i in chosen],
            drafter(kind, draft_len, tokenizer),
            draft_len,
            end,
            stop,
            prefill,
        )
        tokens, steps = tokens + counts[0], steps + counts[1]
    return tokens / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--draft-len", type=int, default=3)
    parser.add_argument(
        "--phrasings", default="original", help="comma-separated: original, rephrased, or a style of rephrase.py"
    )
    parser.add_argument("--outputs", type=Path, default=None, help="the folder where the greedy outputs are kept")
    args = parser.parse_args()

    from benchmarks.rephrase import phrased_groups
    from guidespec import envs
    from guidespec.model_files import load_tokenizer, resolve_model_dir

    folder = args.outputs or envs.cache_dir() / "bench"
    tokenizer = load_tokenizer(resolve_model_dir(None, show_progress=False))
    stop = int(tokenizer.eos_token_id)
    rows = [
        ("perfect drafts", "perfect"),
        ("grammar-forced drafts only", "forced"),
        ("n-gram + forced, no anchored lookup", "ngram"),
        ("n-gram + forced, anchored lookup, no text lookup", "anchored"),
        ("n-gram + forced, anchored and text lookup", "text"),
    ]
    now: dict[str, dict[str, float]] = {}  # phrasing -> drafter -> tokens per step, the engine now
    for phrasing in args.phrasings.split(","):
        cases = [case for group in phrased_groups(phrasing, args.cases) for case in group]
        path = folder / f"jme-greedy-{phrasing}-{args.cases}-{args.max_tokens}.json"
        outputs = greedy_outputs(path, cases, args.max_tokens)
        new_matchers = matchers(tokenizer, stop, outputs)
        print(
            f"\n{len(outputs)} JME cases ({phrasing}), greedy, max_tokens {args.max_tokens}, "
            f"draft length {args.draft_len}\n"
        )
        print(
            "| drafter, replayed | tokens/step | with a complete output ending without a step | and drafts verified "
            "in the prefill step (the engine now) |"
        )
        print("|---|---:|---:|---:|")
        for name, kind in rows:
            figures = [
                tokens_per_step(outputs, new_matchers, kind, tokenizer, args.draft_len, (end, prefill, stop))
                for end, prefill in ((False, False), (True, False), (True, True))
            ]
            now.setdefault(phrasing, {})[name] = figures[-1]
            print(f"| {name} | " + " | ".join(f"{f:.2f}" for f in figures) + " |", flush=True)
    if len(now) > 1:
        print("\nTokens per step, the engine now (drafts in the prefill step, a complete output ends without one)\n")
        print("| drafter, replayed | " + " | ".join(now) + " |")
        print("|---|" + "---:|" * len(now))
        for name, _ in rows:
            print(f"| {name} | " + " | ".join(f"{figures[name]:.2f}" for figures in now.values()) + " |")


def drafter(kind: str, draft_len: int, tokenizer: Any) -> Callable[[], Propose] | None:
    """A new request's propose for ``kind``; one n-gram drafter per replay (its public pool spans
    requests, as in one engine)."""
    from guidespec.config import SpeculativeConfig
    from guidespec.scheduler.speculation.ngram import ngram_drafter

    if kind == "perfect":
        return None
    if kind == "forced":
        return lambda: lambda context, committed, valid: []
    cfg = SpeculativeConfig(max_draft_len=draft_len, anchored_lookup=kind != "ngram")
    lookup = ngram_drafter(cfg, tokenizer, text_lookup=kind == "text")
    ids = iter(range(1 << 30))

    def make() -> Propose:
        request_id = str(next(ids))
        return lambda context, committed, valid: lookup.propose(request_id, context, committed, draft_len, valid)

    return make


if __name__ == "__main__":
    main()
