"""torch's profiler on rank 0 over batch-16 guided, then unguided, EAGLE graph steps on a GPU.

    GUIDESPEC_TORCH_PROFILER_DIR=/tmp/wprof GRAPH=1 python3 scripts/gpu_profile_eagle.py

Random weights of SmolLM2-135M's shape (built in /tmp/gpu-model, the tokenizer from .gpu/tok:
scripts/gpu_carry.sh), a random EAGLE-3 head, draft length 3, the GPU benchmark's embedded
schemas. Each window's Chrome trace is written gzipped to $OUT (default /tmp/out). GRAPH=0 runs
the draft steps one by one instead.
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu import embedded_cases, guided_params, requests, run_each  # noqa: E402
from benchmarks.random_model import build_random_eagle_head, build_random_model  # noqa: E402
from guidespec import LLM, SamplingParams  # noqa: E402


def main() -> None:
    profiles = Path(os.environ["GUIDESPEC_TORCH_PROFILER_DIR"])
    profiles.mkdir(parents=True, exist_ok=True)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    model = build_random_model("smollm2-135m", Path("/tmp/gpu-model"), Path(".gpu/tok"))
    head = build_random_eagle_head(model, Path("/tmp/gpu-model-eagle"))
    eagle = {"method": "eagle", "draft_model": str(head), "adaptive": False, "max_draft_len": 3}
    pairs = requests(embedded_cases(), 16)
    prompts, schemas = [p for p, _ in pairs], [s for _, s in pairs]
    options = dict(dtype="bfloat16", device="cuda", max_batch_size=16, show_progress=False)
    graph = os.environ.get("GRAPH", "1") == "1"
    with LLM(model=str(model), enable_prefix_caching=False, speculative=eagle, graph_grammar=graph, **options) as llm:

        def tick() -> None:  # one small step: rank 0 checks the window's file before each step
            run_each(llm, prompts[:1], [SamplingParams(max_tokens=2, temperature=0.0)])

        outs, _ = run_each(llm, prompts, guided_params(schemas, 128))
        lengths = [len(o.token_ids) for o in outs]
        plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
        for name, params in (("guided", guided_params(schemas, 128)), ("unguided", plain)):
            run_each(llm, prompts, params)  # warm-up: graphs captured, grammars compiled
            (profiles / "on").touch()
            tick()
            _, wall = run_each(llm, prompts, params)
            (profiles / "on").unlink()
            tick()
            print(name, f"{wall:.3f} s", flush=True)
    time.sleep(2)
    for trace in sorted(profiles.glob("rank0-*.json")):
        with open(trace, "rb") as src, gzip.open(out / (trace.name + ".gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        print(trace.name, trace.stat().st_size, flush=True)


if __name__ == "__main__":
    main()
