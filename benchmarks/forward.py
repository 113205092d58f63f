"""One model forward (+ LM head) of the default model, in process, with the CPU kernels on and off:
what a decode step (1 new token per row) and a verification step (1 + draft length tokens per
row) cost, at batch 1 and 16, each row with a context of --context tokens.

    python benchmarks/forward.py [--context 700] [--repeats 10] [--quantized]

"kernels off" is ``GUIDESPEC_CPU_KERNELS=0``: torch's linear layers and attention. "on" is the
engine's path, every layer in one C call (``kernels/decoder.c``) where it applies; the same
forward through the model's Python loop is shown too, with the time spent in the linear layers
and in attention apart (wall time of those calls).
``--quantized`` compares the GGUF file's own blocks (``LlamaModel(quantized=True)``, the
columns "on") with its fp32 weights (the columns "off"), kernels on in both.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine  # noqa: E402

SHAPES = [(1, 1), (1, 4), (1, 8), (16, 1), (16, 4)]  # (rows, new tokens per row)


def measure(context: int, repeats: int, quantized: bool = False) -> dict[tuple[int, int], dict[str, float]]:
    import guidespec.worker.model as model_mod
    from guidespec.config import ModelConfig
    from guidespec.worker import kernels
    from guidespec.model_files import load_hf_config, resolve_model_dir
    from guidespec.worker.tp import TPInfo

    kernels.loader.library.cache_clear()
    spent: dict[str, float] = defaultdict(float)

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return wrapper

    linear, attend = model_mod.linear, model_mod.LlamaModel._attend_group
    model_mod.linear = timed("linear", linear)
    model_mod.LlamaModel._attend_group = timed("attention", attend)  # type: ignore[method-assign]
    try:
        model_dir = resolve_model_dir(None, show_progress=False)
        hf = load_hf_config(model_dir)
        model = model_mod.LlamaModel(
            ModelConfig.from_hf(hf), TPInfo(), torch.float32, context + 64, quantized=quantized
        )
        model.load(model_dir, hf, show_progress=False)
        kv = model.create_kv_cache(16)
        for slot in range(16):
            model.forward(model_mod.ForwardBatch.create(np.arange(context), [slot], [0], [context], [1]), kv)
        results = {}
        stack = model._stack if model._stack_checked else model._build_stack()
        for rows, n in SHAPES:
            batch = model_mod.ForwardBatch.create(
                np.arange(rows * n) % 1000, list(range(rows)), [context] * rows, [n] * rows, [n] * rows
            )
            times = {}
            for path in ("one call", "loop"):  # decoder.c's one call where it applies, then the Python loop
                model._stack, model._stack_checked = (stack if path == "one call" else None), True
                model.compute_logits(model.forward(batch, kv))  # warm
                spent.clear()
                start = time.perf_counter()
                for _ in range(repeats):
                    model.compute_logits(model.forward(batch, kv))
                times[path] = time.perf_counter() - start
            results[(rows, n)] = {"total": times["one call"], "loop": times["loop"], **spent}
        return {k: {name: 1000 * v / repeats for name, v in r.items()} for k, r in results.items()}
    finally:
        model_mod.linear, model_mod.LlamaModel._attend_group = linear, attend  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quantized", action="store_true", help="on: the GGUF's blocks, off: fp32 weights")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    on = measure(args.context, args.repeats, quantized=args.quantized)
    if not args.quantized:
        os.environ["GUIDESPEC_CPU_KERNELS"] = "0"
    off = measure(args.context, args.repeats)
    print(f"{machine()}; context {args.context} tokens per row; ms per forward + LM head")
    print("on: GGUF blocks, off: fp32 weights (kernels on)\n" if args.quantized else "")
    print(
        "| rows × new tokens | on | on, Python loop (linear / attention) | off, Python loop (linear / attention) "
        "| off ÷ on | ÷ 1 × 1 token, on | ÷ 1 × 1 token, off |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key in SHAPES:
        a, b = on[key], off[key]
        print(
            f"| {key[0]} × {key[1]} | {a['total']:.1f} | {a['loop']:.1f} ({a['linear']:.1f} / {a['attention']:.1f}) | "
            f"{b['loop']:.1f} ({b['linear']:.1f} / {b['attention']:.1f}) | {b['total'] / a['total']:.2f}x | "
            f"{a['total'] / on[(1, 1)]['total']:.2f} | {b['total'] / off[(1, 1)]['total']:.2f} |"
        )


if __name__ == "__main__":
    main()
