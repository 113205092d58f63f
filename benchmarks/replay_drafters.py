"""Drafters replayed offline on the JME cases' greedy outputs: tokens per step without the model.

    python benchmarks/replay_drafters.py [--cases 10] [--max-tokens 256] [--draft-len 3] [--outputs FILE]

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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

Propose = Callable[[list[int], int, Callable[[Sequence[int]], int]], list[int]]


def greedy_outputs(path: Path, cases: int, max_tokens: int) -> list[dict[str, Any]]:
    if path.exists():
        data = json.loads(path.read_text())
        if data["cases"] == cases and data["max_tokens"] == max_tokens:
            return list(data["outputs"])
    from guidespec import LLM, RequestError, SamplingParams
    from guidespec.launch.sweep import default_workload, load_workload
    from guidespec.protocol import GuidedDecoding

    outputs = []
    with LLM(show_progress=False, speculative=dict(method="ngram", adaptive=False)) as llm:
        for case in load_workload(default_workload(), "JME_", cases):
            try:
                out = llm.generate(
                    case["messages"],
                    SamplingParams(
                        max_tokens=max_tokens, temperature=0.0, guided=GuidedDecoding(json_schema=case["schema"])
                    ),
                )[0]
            except RequestError:
                continue  # a schema the backend refuses
            outputs.append(
                dict(
                    schema=case["schema"],
                    prompt=list(map(int, out.prompt_token_ids)),
                    output=list(map(int, out.token_ids)),
                )
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(cases=cases, max_tokens=max_tokens, outputs=outputs)))
    return outputs


def replay(
    outputs: list[dict[str, Any]],
    backend: Any,
    compiled: list[Any],
    make: Callable[[], Propose] | None,
    draft_len: int,
    end_without_step: bool,
    stop: int,
    prefill_drafts: bool = False,
) -> float:
    """Tokens per step of one drafter (``make``: a new request's propose; None: perfect drafts)."""
    tokens = steps = 0
    for case, grammar in zip(outputs, compiled):
        matcher = backend.create_matcher(grammar)
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
    return tokens / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--draft-len", type=int, default=3)
    parser.add_argument("--outputs", type=Path, default=None, help="where the greedy outputs are kept")
    args = parser.parse_args()

    from guidespec import envs
    from guidespec.config import SpeculativeConfig
    from guidespec.grammar_backends import create_backend
    from guidespec.protocol import GuidedDecoding
    from guidespec.spec.drafters import ngram_drafter
    from guidespec.model_files import load_tokenizer, resolve_model_dir

    path = args.outputs or envs.cache_dir() / "bench" / f"jme-greedy-{args.cases}-{args.max_tokens}.json"
    outputs = greedy_outputs(path, args.cases, args.max_tokens)
    tokenizer = load_tokenizer(resolve_model_dir(None, show_progress=False))
    stop = int(tokenizer.eos_token_id)
    backend = create_backend("xgrammar", tokenizer, len(tokenizer), (stop,))
    compiled = [backend.compile(GuidedDecoding(json_schema=case["schema"])) for case in outputs]

    def drafter(kind: str) -> Callable[[], Propose] | None:
        """A new request's propose for ``kind``; one n-gram drafter per replay (its public pool
        spans requests, as in one engine)."""
        if kind == "perfect":
            return None
        if kind == "forced":
            return lambda: lambda context, committed, valid: []
        lookup = ngram_drafter(
            SpeculativeConfig(max_draft_len=args.draft_len, anchored_lookup=kind == "anchored"), tokenizer
        )
        ids = iter(range(1 << 30))

        def make() -> Propose:
            request_id = str(next(ids))
            return lambda context, committed, valid: lookup.propose(
                request_id, context, committed, args.draft_len, valid
            )

        return make

    rows = [
        ("perfect drafts", "perfect"),
        ("grammar-forced drafts only", "forced"),
        ("n-gram + forced, no anchored lookup", "ngram"),
        ("n-gram + forced, anchored lookup", "anchored"),
    ]
    print(f"{len(outputs)} JME cases, greedy, max_tokens {args.max_tokens}, draft length {args.draft_len}\n")
    print(
        "| drafter, replayed | tokens/step | with a complete output ending without a step | and drafts verified "
        "in the prefill step (the engine now) |"
    )
    print("|---|---:|---:|---:|")
    for name, kind in rows:
        figures = [
            replay(outputs, backend, compiled, drafter(kind), args.draft_len, end, stop, prefill)
            for end, prefill in ((False, False), (True, False), (True, True))
        ]
        print(f"| {name} | " + " | ".join(f"{f:.2f}" for f in figures) + " |")


if __name__ == "__main__":
    main()
