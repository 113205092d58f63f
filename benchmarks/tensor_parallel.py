"""Tensor parallelism on the CPU: TP=1 against TP=2 with its collectives through shared memory
(the default for local CPU ranks, ``ipc/collectives.py``) and TP=2 over gloo alone
(``GUIDESPEC_TP_SHM=0``).

    python benchmarks/tensor_parallel.py [--rounds 3] [--dtype float32] [--max-tokens 64]

Each round starts one fresh Python per setting, in turn (so all three meet the same moments of a
noisy machine); in it an engine of the default model serves five requests together (greedy,
a regex-guided one among them, ``ignore_eos``) twice, and the second run is timed: seconds, ms a
step (the longest request's steps), and whether its tokens equal TP=1's. Prints the rounds'
median and range per setting.
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

RUN = r"""
import asyncio, json, sys, time
from guidespec import LLM, SamplingParams
from guidespec.protocol import GuidedDecoding
tp, dtype, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
chats = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Explain in one sentence what a compiler does."}],
    "1, 2, 3,",
]
params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _ in chats]
params[1] = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, guided=GuidedDecoding(regex="[a-z ]+"))

async def together(llm):
    return await asyncio.gather(*(llm.agenerate(c, p) for c, p in zip(chats, params)))

with LLM(max_batch_size=8, show_progress=False, dtype=dtype, tensor_parallel_size=tp) as llm:
    asyncio.run(together(llm))
    start = time.perf_counter()
    outs = asyncio.run(together(llm))
    took = time.perf_counter() - start
steps = max(o.stats.num_steps for o in outs)
print(json.dumps({"s": took, "ms_a_step": 1000 * took / steps, "tokens": [o.token_ids for o in outs]}))
"""

SETTINGS = {"TP=1": (1, "1"), "TP=2, shared memory": (2, "1"), "TP=2, gloo": (2, "0")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="the engines' weights (auto: the GGUF's blocks)")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"# Tensor parallelism on the CPU ({commit()})\n\n{machine()}; dtype {args.dtype}, {args.max_tokens} tokens")
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    same = True
    for _ in range(args.rounds):
        reference = None
        for name, (tp, shm) in SETTINGS.items():
            env = {**os.environ, "GUIDESPEC_TP_SHM": shm}
            cmd = [sys.executable, "-c", RUN, str(tp), args.dtype, str(args.max_tokens)]
            result = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
            reference = result["tokens"] if reference is None else reference
            same = same and result["tokens"] == reference
            rounds[name].append({"seconds": result["s"], "ms a step": result["ms_a_step"]})
    print_rounds_table(rounds, "median (range) of rounds")
    print(f"\nevery setting's tokens equal TP=1's: {same}")


if __name__ == "__main__":
    main()
