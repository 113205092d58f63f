"""Engine start: how long a user waits for ``LLM()``, its first answer and ``close()``.

    python benchmarks/engine_start.py [--model MODEL] [--rounds 3] [--compare DIR]

Each round runs one fresh Python per checkout (``--compare DIR``: another guidespec checkout, the
code before a change, e.g. ``git worktree add DIR <commit>``; its rounds alternate with this
one's, so both meet the same moments of a noisy machine). In it: ``import guidespec``; the
client's first ``LLM(max_batch_size=2)`` (the zygote's imports beside the client's); its first
answer (4 greedy tokens of a short chat); ``close()``; then a second ``LLM()`` in the same, warm
Python (its processes forked from the zygote) and its first answer; then a third ``LLM()`` (the
zygote made the model's tokenizer and grammar tables before forking the second's scheduler). Seconds, the rounds' median
and range. The model's one-time preparation (a GGUF's conversion, its tensor index) happens before
the first round and is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import commit, machine, print_rounds_table  # noqa: E402

ROUND = r"""
import json, sys, time
t0 = time.monotonic()
from guidespec import LLM, SamplingParams
t_import = time.monotonic()
model = sys.argv[1] or None
params = SamplingParams(max_tokens=4, temperature=0.0)
chat = [{"role": "user", "content": "Say hi."}]
llm = LLM(model=model, max_batch_size=2, show_progress=False)
t_ready = time.monotonic()
llm.generate(chat, params)
t_answer = time.monotonic()
llm.close()
t_closed = time.monotonic()
again = LLM(model=model, max_batch_size=2, show_progress=False)
t_ready2 = time.monotonic()
again.generate(chat, params)
t_answer2 = time.monotonic()
again.close()
t_closed2 = time.monotonic()
third = LLM(model=model, max_batch_size=2, show_progress=False)
t_ready3 = time.monotonic()
third.close()
print(json.dumps({
    "import": t_import - t0,
    "first LLM()": t_ready - t_import,
    "its first answer": t_answer - t_ready,
    "close()": t_closed - t_answer,
    "second LLM(), warm Python": t_ready2 - t_closed,
    "its first answer (warm)": t_answer2 - t_ready2,
    "third LLM() (the zygote has the model's tables)": t_ready3 - t_closed2,
}))
"""


def one_round(model: str | None, source: Path | None) -> dict[str, float]:
    env = dict(os.environ)
    if source is not None:  # guidespec from that checkout, in this Python and the engine's processes
        env["PYTHONPATH"] = os.pathsep.join([str(source), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run(
        [sys.executable, "-c", ROUND, model or ""], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"a round failed ({source or 'this checkout'}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model name, folder or .gguf (default: the embedded one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare", type=Path, default=None, help="another guidespec checkout: before / after")
    args = parser.parse_args()

    trees: dict[str, Path | None] = {"after": None} if args.compare is None else {"before": args.compare, "after": None}
    for source in trees.values():  # the model's one-time preparation, outside the rounds
        one_round(args.model, source)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for i in range(args.rounds):
        for name, source in trees.items():
            rounds[name].append(one_round(args.model, source))
            print(f"round {i + 1}, {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in rounds[name][-1].items()))

    print(f"\n# Engine start, {args.model or 'the default model'}: seconds, median (range) of {args.rounds} rounds")
    print(f"- {machine()}; commit {commit()}" + (f"; before = {args.compare}" if args.compare else ""))
    print_rounds_table({name: rounds[name] for name in trees})


if __name__ == "__main__":
    main()
