"""Decode throughput: guidespec vs Hugging Face ``generate``, same model, same dtype, one run.

    python benchmarks/decode.py [--batch-sizes 1 4 16] [--max-tokens 128] [--dtype float32]

For each batch size B, B chat prompts from the workload's JME cases are generated greedily
for exactly ``max_tokens`` tokens (EOS ignored) by guidespec and by transformers; tokens/s is
output tokens over wall time (prefill included, as a user sees it). Also reported: the
fraction of the memory-bandwidth limit reached by guidespec, i.e. weight bytes read per step
x steps per second / measured bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine, memory_bandwidth_gb_s, workload_chats  # noqa: E402


def run_guidespec(chats: list, batch_sizes: list[int], max_tokens: int, dtype: str) -> dict[int, float]:
    from guidespec import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results = {}
    with LLM(dtype=dtype, max_batch_size=max(batch_sizes), show_progress=False) as llm:
        llm.generate(chats[:1], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
        for b in batch_sizes:
            start = time.perf_counter()
            outs = llm.generate(chats[:b], params)
            wall = time.perf_counter() - start
            results[b] = sum(len(o.token_ids) for o in outs) / wall
            print(f"guidespec  batch {b:>2}: {results[b]:7.1f} tok/s", flush=True)
    return results


def run_hf(chats: list, batch_sizes: list[int], max_tokens: int, dtype: str) -> dict[int, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from guidespec.model_files import resolve_model_dir

    model_dir = resolve_model_dir(None, show_progress=False)
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    results = {}
    for b in batch_sizes:
        texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats[:b]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        if b == batch_sizes[0]:
            model.generate(**enc, max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        wall = time.perf_counter() - start
        results[b] = (out.shape[1] - enc["input_ids"].shape[1]) * b / wall
        print(f"HF generate batch {b:>2}: {results[b]:7.1f} tok/s", flush=True)
    return results


def weight_bytes(dtype: str) -> int:
    """Bytes of weights read per forward step (the tied embedding is read once, as the head)."""
    from transformers import AutoConfig

    from guidespec.model_files import resolve_model_dir

    cfg = AutoConfig.from_pretrained(resolve_model_dir(None, show_progress=False))
    h, i, layers, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return (layers * per_layer + v * h + h) * torch.tensor([], dtype=getattr(torch, dtype)).element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    chats = workload_chats("JME_")
    torch.set_num_threads(torch.get_num_threads())
    ours = run_guidespec(chats, args.batch_sizes, args.max_tokens, args.dtype)
    hf = run_hf(chats, args.batch_sizes, args.max_tokens, args.dtype)
    bw = memory_bandwidth_gb_s()
    wbytes = weight_bytes(args.dtype)
    print(
        f"\n{machine()}; read bandwidth {bw['read_gb_s']:.1f} GB/s, copy bandwidth {bw['copy_gb_s']:.1f} GB/s; "
        f"weights read per step {wbytes / 1e6:.0f} MB ({args.dtype})\n"
    )
    print("| batch | guidespec tok/s | HF generate tok/s | ratio | steps/s | weight GB/s | of read bw | of copy bw |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for b in args.batch_sizes:
        steps = ours[b] / b
        gbs = wbytes * steps / 1e9
        rows.append({"batch": b, "guidespec": ours[b], "hf": hf[b], "ratio": ours[b] / hf[b], "weight_gb_s": gbs})
        print(
            f"| {b} | {ours[b]:.1f} | {hf[b]:.1f} | {ours[b] / hf[b]:.2f}x | {steps:.1f} | {gbs:.1f} | "
            f"{gbs / bw['read_gb_s']:.0%} | {gbs / bw['copy_gb_s']:.0%} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rows": rows,
                    "bandwidth": bw,
                    "machine": machine(),
                    "max_tokens": args.max_tokens,
                    "dtype": args.dtype,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
