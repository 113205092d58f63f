"""Routing policies' prefix-cache hit rates over local replicas (``EngineGroup``, no Ray): the
workload of ``data_parallel.py`` (its agents' system prompts x answer schemas x users), so a
routing change can be measured in minutes without a Ray cluster.

    python benchmarks/routing_hits.py [--replicas 4] [--requests 128] [--concurrency 16]
        [--kv-cache-tokens 2624] [--policies cache_aware,round_robin] [--balance 1.25]

For each policy: one ``EngineGroup`` of ``--replicas`` engines (one worker thread each), the
requests sent ``--concurrency`` at a time, then the hit rate (prompt tokens found cached over
looked up, all replicas), the router's decisions, preemptions and each replica's requests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.data_parallel import ANSWERS, USERS, agent_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kv-cache-tokens", type=int, default=2624, help="per replica")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--policies", default="cache_aware,round_robin")
    parser.add_argument("--balance", type=float, default=None, help="the load bound")
    args = parser.parse_args()
    os.environ.setdefault("GUIDESPEC_WORKER_THREADS", "1")
    from guidespec import SamplingParams
    from guidespec.entrypoints.data_parallel import EngineGroup
    from guidespec.protocol import GuidedDecoding

    prompts = agent_prompts(args.agents, 5)
    rng = random.Random(0)
    work = [
        (rng.randrange(len(prompts)), ANSWERS[rng.randrange(3)], f"User {i}: {USERS[rng.randrange(len(USERS))]}")
        for i in range(args.requests)
    ]
    for policy in args.policies.split(","):
        group = EngineGroup(
            args.replicas,
            routing=policy,
            max_batch_size=args.concurrency,
            max_model_len=2048,
            kv_cache_tokens=args.kv_cache_tokens,
            show_progress=False,
        )
        if args.balance is not None and hasattr(group.router, "balance"):
            group.router.balance = args.balance

        def one(item: tuple[int, dict, str]) -> str:
            agent, schema, user = item
            messages = [{"role": "system", "content": prompts[agent]}, {"role": "user", "content": user}]
            guided = GuidedDecoding(json_schema=json.dumps(schema))
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, guided=guided)
            return group.generate([messages], params)[0].replica or ""

        start = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            replicas = Counter(pool.map(one, work))
        wall = time.monotonic() - start
        stats = group.scheduler_stats
        group.close()
        hit = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        decisions = dict(getattr(group.router, "decisions", {}))
        print(
            f"{policy}: hit rate {hit:.3f}, {wall:.1f} s, preemptions {stats.num_preemptions}, "
            f"decisions {decisions}, requests per replica {sorted(replicas.values(), reverse=True)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
