"""Many requests that begin the same way: an agent's long system prompt (its tools' JSON schemas),
then a short user turn, each answered as guided JSON (issue 47's table).

    python benchmarks/shared_prefix.py [--requests 32] [--sequential 32] [--max-batch-size 64]
        [--max-model-len 8192] [--max-tokens 24] [--tools 18] [--kv-cache-tokens N] [--kv-block-size N]

Prints, for the requests sent all at once and for as many sent one after another (other user
turns, the same system prompt): prompt tokens, those served from the prefix cache and those
computed, wall time, preemptions, and the engine's resident memory (the scheduler's and workers'
RSS, summed) after start and after each part, beside the bytes of KV the tokens held at once
take (the system prompt once, each request's own tokens) and the bytes of the KV blocks
ever written (the pool's high-water mark: what the cache keeps resident, cached prefixes included). The system prompt is
built from the first ``--tools`` schemas of the JSONSchemaBench workload (real tool schemas,
~1,600 tokens for 18), the user turns ask for one small JSON object each. ``--sequential 0``
with ``--requests 256 --max-batch-size 256`` is the goal of 256 requests at once at 8k.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from guidespec import LLM, SamplingParams
from guidespec.protocol import GuidedDecoding

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import WORKLOAD  # noqa: E402

ANSWER = {
    "type": "object",
    "properties": {"tool": {"type": "string"}, "reason": {"type": "string", "maxLength": 40}},
    "required": ["tool", "reason"],
}


def system_prompt(num_tools: int) -> str:
    tools = []
    with WORKLOAD.open() as f:
        for line in f:
            case = json.loads(line)
            if case["id"].startswith("BFCL") and len(tools) < num_tools:
                tools.append(json.loads(case["schema"]) if isinstance(case["schema"], str) else case["schema"])
    listing = "\n".join(f"- tool {i}: {json.dumps(t, separators=(',', ':'))}" for i, t in enumerate(tools))
    return (
        "You are an assistant that picks the one tool that fits the user's request and says why in a few "
        f"words. Answer with a JSON object.\nThe tools:\n{listing}"
    )


def engine_rss_gb(llm: LLM) -> float:
    total = 0
    for process in llm._processes.processes.values():
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
        except OSError:
            continue
        total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return total / 1024**2


def kv_bytes_per_token(llm: LLM) -> int:
    from guidespec.config import ModelConfig
    from guidespec.model_files import load_hf_config

    cfg = ModelConfig.from_hf(load_hf_config(llm.config.model_dir, llm.config.hf_config))
    item = 2 if llm.config.dtype in ("bfloat16", "float16") else 4
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * item


def run(
    llm: LLM, prompts: list[list[dict[str, str]]], params: SamplingParams, together: bool, shared: int
) -> dict[str, float]:
    preempted = llm.scheduler_stats.num_preemptions
    start = time.perf_counter()
    if together:
        outputs = llm.generate(prompts, params)
    else:
        outputs = [llm.generate([prompt], params)[0] for prompt in prompts]
    wall = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.stats.num_cached_tokens for o in outputs)
    valid = sum(_valid(o.text) for o in outputs)
    own = sum(len(o.prompt_token_ids) - shared + len(o.token_ids) for o in outputs)
    held = (shared + own) if together else max(len(o.prompt_token_ids) + len(o.token_ids) for o in outputs)
    time.sleep(0.3)  # (the scheduler's figures come every 0.1 s)
    written = llm.scheduler_stats.kv_blocks_written * llm.kv_block_size * kv_bytes_per_token(llm)
    return {
        "requests": len(outputs),
        "prompt tokens": prompt_tokens,
        "from cache": cached,
        "computed": prompt_tokens - cached,
        "wall s": round(wall, 2),
        "valid": valid,
        "preempted": llm.scheduler_stats.num_preemptions - preempted,
        "KV GB of the tokens at once": round(held * kv_bytes_per_token(llm) / 1e9, 3),
        "KV GB written (pool)": round(written / 1e9, 3),
        "engine RSS GB": round(engine_rss_gb(llm), 2),
    }


def _valid(text: str) -> bool:
    try:
        answer = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(answer, dict) and {"tool", "reason"} <= answer.keys()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--sequential", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--tools", type=int, default=18)
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--kv-block-size", type=int, default=16)
    args = parser.parse_args()
    system = system_prompt(args.tools)
    asks = ["find the weather in a city", "convert a currency", "book a table", "translate a sentence"]
    prompts = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"Request {i}: {asks[i % len(asks)]}."}]
        for i in range(args.requests + args.sequential)
    ]
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.0,
        guided=GuidedDecoding(json_schema=json.dumps(ANSWER)),
    )
    with LLM(
        max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_block_size=args.kv_block_size,
    ) as llm:
        shared = len(llm.encode_prompt([{"role": "system", "content": system}]))
        print(f"system prompt: {shared} tokens; KV cache: {llm.num_kv_blocks} blocks of {llm.kv_block_size}")
        print(f"engine RSS after start: {engine_rss_gb(llm):.2f} GB")
        shared -= 8  # (the chat template's end of the system turn may merge with the user turn's start)
        rows = [("at once", run(llm, prompts[: args.requests], params, together=True, shared=shared))]
        if args.sequential:
            later = prompts[args.requests :]
            rows.append(("one after another", run(llm, later, params, together=False, shared=shared)))
    keys = list(rows[0][1])
    print("\n| sent | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for name, row in rows:
        print(f"| {name} | " + " | ".join(str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
