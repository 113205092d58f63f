"""The default model with the GGUF file's own quantized blocks against its fp32 weights, in
process (one model, no engine): greedy output and decode speed on the workload's chat prompts.

    python benchmarks/quantized.py [--prompts 5] [--max-tokens 64] [--rounds 3] [--threads 2] [--cpu-time]

For each prompt both models generate ``max_tokens`` tokens greedily (EOS ignored); reported:
the tokens until the first difference and the tokens equal position by position. Speed is
tokens/s of batch-1 generation, prefill included (the wall time a user waits), and the time
of one decode step and one 4-token verification step at a 512-token context; each is the best
of ``rounds`` runs that alternate the two models, as other work shares the cores. Where that
work is heavy, ``--threads 1 --cpu-time`` times with this process's CPU time instead of the
wall clock: what a step costs a core, not how long other work kept it waiting.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine, workload_chats  # noqa: E402

Clock = Callable[[], float]  # time.perf_counter, or time.process_time (--cpu-time)


def load(quantized: bool, max_len: int, model_dir: Path | None = None) -> Any:
    """A one-rank fp32 ``LlamaModel`` of ``model_dir`` (default: the default model), loaded."""
    from guidespec.config import ModelConfig
    from guidespec.model_files import load_hf_config, resolve_model_dir
    from guidespec.worker.model import LlamaModel
    from guidespec.worker.tp import TPInfo

    if model_dir is None:
        model_dir = resolve_model_dir(None, show_progress=False)
    hf = load_hf_config(model_dir)
    model = LlamaModel(ModelConfig.from_hf(hf), TPInfo(), torch.float32, max_len, quantized=quantized)
    model.load(model_dir, hf, show_progress=False)
    return model


def greedy(model: Any, prompt: list[int], max_tokens: int, clock: Clock = time.perf_counter) -> tuple[list[int], float]:
    """``max_tokens`` greedy tokens after ``prompt`` and the wall time, prefill included."""
    from guidespec.worker.model import ForwardBatch

    kv = model.create_kv_cache(1)
    start = clock()
    batch = ForwardBatch.create(prompt, [0], [0], [len(prompt)], [1])
    tokens: list[int] = []
    for _ in range(max_tokens):
        tokens.append(int(model.compute_logits(model.forward(batch, kv))[-1].argmax()))
        batch = ForwardBatch.create(tokens[-1:], [0], [len(prompt) + len(tokens) - 1], [1], [1])
    return tokens, clock() - start


def step_ms(model: Any, new_tokens: int, clock: Clock, context: int = 512, repeats: int = 10) -> float:
    """One forward + LM head of ``new_tokens`` tokens after ``context`` cached ones, in ms: the
    fastest of ``repeats`` (the least disturbed by other work on the cores)."""
    from guidespec.worker.model import ForwardBatch

    kv = model.create_kv_cache(1)
    model.forward(ForwardBatch.create(np.arange(context) % 1000, [0], [0], [context], [1]), kv)
    batch = ForwardBatch.create(np.arange(new_tokens), [0], [context], [new_tokens], [new_tokens])
    model.compute_logits(model.forward(batch, kv))
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        model.compute_logits(model.forward(batch, kv))
        best = min(best, clock() - start)
    return 1000 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--speed-only", action="store_true", help="skip the greedy comparison")
    parser.add_argument("--cpu-time", action="store_true", help="time with CPU time (use with --threads 1)")
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    from guidespec.model_files import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(None, show_progress=False))
    encoded = [
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        for chat in workload_chats(limit=args.prompts)
    ]
    prompts = [list(ids["input_ids"] if hasattr(ids, "keys") else ids) for ids in encoded]
    max_len = max(map(len, prompts)) + args.max_tokens + 600
    models = {"fp32": load(False, max_len), "gguf": load(True, max_len)}
    print(
        f"{machine()}; {args.threads} threads, {'CPU' if args.cpu_time else 'wall'} time; weights kept as blocks: "
        f"{type(models['gguf'].layers[0]['qkv']).__name__}, LM head {type(models['gguf'].lm_head).__name__}\n"
    )
    print("| prompt | prompt tokens | equal until | equal positions |\n|---:|---:|---:|---:|")
    outputs: dict[str, list[list[int]]] = {"fp32": [], "gguf": []}
    for i, prompt in enumerate([] if args.speed_only else prompts):
        for name, model in models.items():
            outputs[name].append(greedy(model, prompt, args.max_tokens)[0])
        a, b = outputs["fp32"][i], outputs["gguf"][i]
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"| {i} | {len(prompt)} | {first} / {len(a)} | {sum(x == y for x, y in zip(a, b))} |", flush=True)
    best: dict[str, dict[str, float]] = {name: {} for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            wall = sum(greedy(model, p, args.max_tokens, clock)[1] for p in prompts[:2])
            for key, value in (
                ("tok/s", 2 * args.max_tokens / wall),
                ("decode ms", -step_ms(model, 1, clock)),
                ("verify-4 ms", -step_ms(model, 4, clock)),
                ("prefill-256 ms", -step_ms(model, 256, clock, 64, 2)),
            ):
                best[name][key] = max(best[name].get(key, -1e9), value)
    print(
        "\n| weights | tok/s (batch 1, prefill included) | decode step ms | 4-token verify ms | 256-token prefill ms |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, r in best.items():
        cells = f"{r['tok/s']:.1f} | {-r['decode ms']:.1f} | {-r['verify-4 ms']:.1f} | {-r['prefill-256 ms']:.0f}"
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
