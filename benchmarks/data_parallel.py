"""Data-parallel replicas on Ray Serve (issue 50): cache-aware routing against round-robin, one
replica against two, and a replica killed under load, on a local Ray cluster this script starts.

    python benchmarks/data_parallel.py [--agents 8] [--tools-per-agent 5] [--schemas 3]
        [--requests 96] [--concurrency 8] [--max-tokens 24] [--skew 0.8] [--kv-cache-tokens N]
        [--parts aware,robin,skewed,one,kill]

The workload: ``--agents`` system prompts (each an agent's tools: ``--tools-per-agent`` real tool
schemas of the JSONSchemaBench workload, ~450 tokens) x ``--schemas`` answer schemas x many
users (each request one agent, one schema, a user turn of its own), sent to the ingress's
OpenAI route ``--concurrency`` at a time, answered as guided JSON. Each replica's KV cache holds
1.5x its share of the agents' prompts (``--kv-cache-tokens``; default: 1.5 x the agents'
prompt tokens / replicas, plus a little), as a replica's cache holds part of a real fleet's
prefixes: room for its own share with cache-aware routing, for part of them all with round-robin
(which sends every agent to every replica: its hit rate is about the cache's share of all the
agents' prompts, 1.5 / replicas, whatever the routing of the others).

Parts (each a fresh application: cold caches):
- ``aware`` / ``robin``: 2 replicas, cache-aware routing / round-robin, agents chosen uniformly:
  the prefix cache's hit rate (prompt tokens found cached / looked up, all replicas), grammars
  compiled and shared, throughput, p50 / p99 latency, and each replica's share of the requests;
- ``skewed``: 2 replicas, cache-aware, one agent ``--skew`` of the requests: the busiest
  replica's share of the requests over the mean share, and the hit rate;
- ``one``: 1 replica, the ``aware`` workload: throughput and latency against 2;
- ``kill``: 2 replicas, cache-aware; a third of the way through, one replica's actor is killed:
  the requests that failed (503) and how long until a fresh replica served a request.

Each replica is one engine with one worker thread (``GUIDESPEC_WORKER_THREADS=1``): on this
2-core machine, one core each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import WORKLOAD, commit, machine  # noqa: E402

ANSWERS = [
    {
        "type": "object",
        "properties": {"tool": {"type": "string"}, "reason": {"type": "string", "maxLength": 40}},
        "required": ["tool", "reason"],
    },
    {
        "type": "object",
        "properties": {"tool": {"type": "string"}, "confidence": {"type": "number"}},
        "required": ["tool", "confidence"],
    },
    {
        "type": "object",
        "properties": {"tools": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
        "required": ["tools"],
    },
    {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 60}}, "required": ["answer"]},
]
USERS = [
    "I need the weather for tomorrow in Lisbon.",
    "Book me a table for two at eight.",
    "What is 17 percent of 2,340?",
    "Find flights from Oslo to Rome next Friday.",
    "Convert 120 US dollars to euros.",
    "Remind me to call my sister on Sunday.",
    "How far is the moon from the earth?",
    "Translate 'good morning' into Japanese.",
]


def agent_prompts(agents: int, tools_per_agent: int) -> list[str]:
    tools = []
    with WORKLOAD.open() as f:
        for line in f:
            case = json.loads(line)
            if case["id"].startswith("BFCL"):
                tools.append(json.loads(case["schema"]) if isinstance(case["schema"], str) else case["schema"])
    prompts = []
    for a in range(agents):
        mine = [tools[(a * tools_per_agent + i) % len(tools)] for i in range(tools_per_agent)]
        listing = "\n".join(f"- tool {i}: {json.dumps(t, separators=(',', ':'))}" for i, t in enumerate(mine))
        prompts.append(
            f"You are agent {a} of the help desk. Pick the tool that fits the user's request and answer "
            f"with a JSON object.\nYour tools:\n{listing}"
        )
    return prompts


@dataclass
class Part:
    name: str
    statuses: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)
    done_at: list[float] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    hit_rate: float = 0.0
    compiled: float = 0.0
    shared: float = 0.0
    recovery_s: float | None = None
    failed_503: int = 0


def metric(url: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics", timeout=30).text, re.M)
    return float(found.group(1)) if found else 0.0


def run_part(
    name: str,
    args: argparse.Namespace,
    prompts: list[str],
    replicas: int,
    routing: str,
    skew: float | None = None,
    kill: bool = False,
) -> Part:
    from ray import serve

    from guidespec.entrypoints.ray_serve import build_app

    grammars = tempfile.mkdtemp(prefix="gs-grammars-")  # (the replicas' shared compiled grammars, this part's)
    app = build_app(
        None,
        grammar_cache_dir=grammars,
        num_replicas=replicas,
        routing=routing,
        max_batch_size=args.concurrency,
        max_model_len=2048,
        kv_cache_tokens=args.kv_cache_tokens,
        show_progress=False,
    )
    serve.run(app, name="guidespec", route_prefix="/")
    url = f"http://127.0.0.1:{args.port}"
    rng = random.Random(0)
    work = []
    for i in range(args.requests):
        agent = 0 if skew is not None and rng.random() < skew else rng.randrange(len(prompts))
        schema = ANSWERS[rng.randrange(args.schemas)]
        user = f"User {i}: {USERS[rng.randrange(len(USERS))]}"
        work.append((agent, schema, user))
    part = Part(name)
    lock = threading.Lock()
    killed_at: list[float] = []

    def one(item: tuple[int, dict[str, Any], str]) -> None:
        agent, schema, user = item
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "system", "content": prompts[agent]}, {"role": "user", "content": user}],
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        }
        start = time.monotonic()
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        with lock:
            part.statuses.append(reply.status_code)
            part.latencies.append(time.monotonic() - start)
            part.done_at.append(time.monotonic())
            part.replicas.append(reply.headers.get("x-guidespec-replica", ""))
            if reply.status_code == 200:
                part.tokens += reply.json()["usage"]["completion_tokens"]
                if killed_at and part.recovery_s is None and reply.headers["x-guidespec-replica"] not in seen_before:
                    part.recovery_s = time.monotonic() - killed_at[0]

    seen_before: set[str] = set()
    queries0 = metric(url, "guidespec_prefix_cache_queries_total")
    hits0 = metric(url, "guidespec_prefix_cache_hits_total")
    start = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        futures = [pool.submit(one, item) for item in work]
        if kill:
            import ray

            while len(part.statuses) < args.requests // 3:
                time.sleep(0.05)
            with lock:
                seen_before.update(r for r in part.replicas if r)
            victim = max(seen_before, key=part.replicas.count)
            killed_at.append(time.monotonic())
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        for future in futures:
            future.result()
    part.wall_s = time.monotonic() - start
    time.sleep(3)  # (the replicas report their counters every second)
    queries = metric(url, "guidespec_prefix_cache_queries_total") - queries0
    part.hit_rate = (metric(url, "guidespec_prefix_cache_hits_total") - hits0) / queries if queries else 0.0
    part.compiled = metric(url, "guidespec_grammars_compiled_total")
    part.shared = metric(url, "guidespec_grammars_shared_total")
    part.failed_503 = part.statuses.count(503)
    serve.delete("guidespec")
    shutil.rmtree(grammars, ignore_errors=True)
    return part


def report(parts: list[Part], args: argparse.Namespace) -> str:
    lines = [
        f"data-parallel replicas on Ray Serve, {machine()}, commit {commit()}",
        f"{args.agents} agents x {args.schemas} answer schemas, {args.requests} requests, {args.concurrency} at once, "
        f"max_tokens {args.max_tokens}, KV cache per replica {args.kv_cache_tokens} tokens, one worker thread "
        f"per replica, {os.cpu_count()} cores in all",
        "",
        "| part | replicas | hit rate | grammars compiled / shared | tok/s | req/s | p50 s | p99 s | "
        "busiest replica's share / mean | 503s | recovery s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in parts:
        ok = [lat for lat, s in zip(p.latencies, p.statuses) if s == 200]
        ok.sort()
        shares = [p.replicas.count(r) for r in set(p.replicas) if r]
        busiest = max(shares) / (sum(shares) / len(shares)) if shares else 0.0
        replicas = len(set(r for r in p.replicas if r))
        lines.append(
            f"| {p.name} | {replicas} | {p.hit_rate:.3f} | {p.compiled:.0f} / {p.shared:.0f} | "
            f"{p.tokens / p.wall_s:.1f} | {len(ok) / p.wall_s:.2f} | {statistics.median(ok):.2f} | "
            f"{ok[min(len(ok) - 1, int(0.99 * len(ok)))]:.2f} | {busiest:.2f} | {p.failed_503} | "
            f"{'–' if p.recovery_s is None else f'{p.recovery_s:.1f}'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--tools-per-agent", type=int, default=5)
    parser.add_argument("--schemas", type=int, default=3, choices=range(1, len(ANSWERS) + 1))
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--skew", type=float, default=0.8)
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument(
        "--replicas",
        type=int,
        default=2,
        help="replicas of every part but 'one' (on this machine they share its cores: hit rates and compiles "
        "do not depend on speed)",
    )
    parser.add_argument("--port", type=int, default=18950)
    parser.add_argument("--parts", default="aware,robin,skewed,one,kill")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()

    os.environ.setdefault("GUIDESPEC_WORKER_THREADS", "1")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    from ray import serve

    from guidespec.launch.ray_executor import join_cluster
    from guidespec.model_files import load_tokenizer, resolve_model_dir

    prompts = agent_prompts(args.agents, args.tools_per_agent)
    tokenizer = load_tokenizer(resolve_model_dir(None))
    chats = [tokenizer.apply_chat_template([{"role": "system", "content": p}], tokenize=False) for p in prompts]
    lengths = [len(tokenizer(text, add_special_tokens=False).input_ids) for text in chats]
    if args.kv_cache_tokens is None:  # 1.5x a replica's share of the agents' prompts, and a little
        share = 1.5 * sum(lengths) / args.replicas + 256
        args.kv_cache_tokens = max(2048, 16 * round(share / 16))
    print(f"agent prompts: {min(lengths)}-{max(lengths)} tokens; KV cache {args.kv_cache_tokens} tokens per replica")
    # (Ray's logical CPUs: one per replica, whatever the machine has)
    join_cluster(None, num_cpus=max(2, args.replicas), include_dashboard=False, object_store_memory=200 * 2**20)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    parts = []
    n = args.replicas
    plan = {
        "aware": dict(replicas=n, routing="cache_aware"),
        "robin": dict(replicas=n, routing="round_robin"),
        "skewed": dict(replicas=n, routing="cache_aware", skew=args.skew),
        "one": dict(replicas=1, routing="cache_aware"),
        "kill": dict(replicas=n, routing="cache_aware", kill=True),
    }
    try:
        for name in args.parts.split(","):
            parts.append(run_part(name, args, prompts, **plan[name]))  # type: ignore[arg-type]
            print(report(parts, args).splitlines()[-1], flush=True)
    finally:
        serve.shutdown()
    text = report(parts, args)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
