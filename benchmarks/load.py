"""A mixed load against one running server: many requests at once, none may be lost.

    python benchmarks/load.py [--requests 500] [--concurrency 500] [--max-tokens 64]
                              [--url http://127.0.0.1:8000 --api-key KEY]   (default: starts a server)

Requests cycle through kinds: guided (a JSON schema from the workload's cases, with and without
the server's drafter), unguided, streamed, streamed then cancelled after the first event, and
bad (a token id past the vocabulary, a broken schema, an unknown field) that must get a 4xx. A
guided request may get a 400 too: a schema its backend refuses to enforce (never silently).
Every request is sent at once (up to ``--concurrency`` in flight). Reported: requests by kind
and outcome, wall time, lost (no answer, a transport error, or a 5xx), and invalid (a guided
200 whose output fails its schema although it finished with ``stop``; one cut by
``max_tokens`` must say ``finish_reason: "length"``). ``tests/entrypoints/server/test_reliability.py``
runs a small load through the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from guidespec.entrypoints.sweep import validate_output  # noqa: E402

WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench" / "workload.jsonl"
KINDS = ("guided", "guided_nospec", "unguided", "streamed", "cancelled", "bad")


@dataclass
class LoadReport:
    requests: int = 0
    wall_s: float = 0.0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)  # "kind status"
    lost: list[str] = field(default_factory=list)  # what went wrong, per lost request
    invalid: list[str] = field(default_factory=list)
    finish_reasons: collections.Counter[str] = field(default_factory=collections.Counter)

    def summary(self) -> str:
        return (
            f"{self.requests} requests in {self.wall_s:.1f} s: lost {len(self.lost)}, invalid "
            f"{len(self.invalid)}; outcomes {dict(sorted(self.outcomes.items()))}; guided finish reasons "
            f"{dict(self.finish_reasons)}"
        )


def load_cases(prefix: str = "", limit: int = 40) -> list[dict[str, Any]]:
    """Workload cases (chat messages and a schema) whose id starts with ``prefix``."""
    cases = [json.loads(line) for line in WORKLOAD.read_text().splitlines() if line.strip()]
    return [c for c in cases if c["id"].startswith(prefix)][:limit]


def build_requests(num_requests: int, max_tokens: int, cases: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(kind, body) for each request, the kinds in turn."""
    out = []
    for i in range(num_requests):
        kind, case = KINDS[i % len(KINDS)], cases[i % len(cases)]
        body: dict[str, Any] = {"messages": case["messages"], "max_tokens": max_tokens, "temperature": 0}
        if kind in ("guided", "guided_nospec"):
            schema = case["schema"] if isinstance(case["schema"], dict) else json.loads(case["schema"])
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "case", "schema": schema}}
            body["speculative"] = kind == "guided"
        elif kind in ("streamed", "cancelled"):
            body["stream"] = True
        elif kind == "bad":
            body = [
                {"prompt": [60000, 1, 2]},
                {"messages": case["messages"], "guided_json": "{not json"},
                {"messages": case["messages"], "colour": "red"},
            ][i // len(KINDS) % 3]
        out.append((kind, body))
    return out


async def run_load(
    url: str,
    api_key: str | None,
    requests: list[tuple[str, dict[str, Any]]],
    concurrency: int,
    timeout_s: float = 600.0,
) -> LoadReport:
    report = LoadReport(requests=len(requests))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s, limits=limits) as http:

        async def one(index: int, kind: str, body: dict[str, Any]) -> None:
            async with gate:
                try:
                    await _send(http, kind, body, report)
                except Exception as e:  # a transport error is a lost request
                    report.lost.append(f"#{index} {kind}: {type(e).__name__}: {e}")

        await asyncio.gather(*(one(i, kind, body) for i, (kind, body) in enumerate(requests)))
    report.wall_s = time.perf_counter() - start
    return report


async def _send(http: httpx.AsyncClient, kind: str, body: dict[str, Any], report: LoadReport) -> None:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    if body.get("stream"):
        async with http.stream("POST", path, json=body) as response:
            events = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if kind == "cancelled":
                        break  # leaving the block closes the connection: the server aborts the request
                    if '"error"' in line:
                        report.lost.append(f"{kind}: an error event: {line[:200]}")
            report.outcomes[f"{kind} {response.status_code}"] += 1
            if response.status_code != 200 or (kind == "streamed" and events == 0):
                report.lost.append(f"{kind}: status {response.status_code}, {events} events")
        return
    response = await http.post(path, json=body)
    report.outcomes[f"{kind} {response.status_code}"] += 1
    if kind == "bad":
        if not 400 <= response.status_code < 500 or "error" not in response.json():
            report.lost.append(f"bad: status {response.status_code}: {response.text[:200]}")
        return
    if kind.startswith("guided") and response.status_code == 400:
        return  # a schema the backend refuses to enforce (counted in outcomes): answered, not lost
    if response.status_code != 200:
        report.lost.append(f"{kind}: status {response.status_code}: {response.text[:200]}")
        return
    if kind.startswith("guided"):
        choice = response.json()["choices"][0]
        report.finish_reasons[choice["finish_reason"]] += 1
        schema = body["response_format"]["json_schema"]["schema"]
        error = validate_output(choice["message"]["content"], schema)
        if error is not None and choice["finish_reason"] != "length":
            report.invalid.append(f"finish {choice['finish_reason']}: {error}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--url", default=None, help="a running server (default: start one here)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--max-batch-size", type=int, default=16, help="of the server started here")
    args = parser.parse_args()
    requests = build_requests(args.requests, args.max_tokens, load_cases())
    server = None
    url = args.url
    if url is None:
        from tests.entrypoints.serving import KEY, start_server

        server = start_server("--max-batch-size", str(args.max_batch_size), "--speculative", "ngram")
        url, args.api_key = server.url, KEY
    try:
        report = asyncio.run(run_load(url, args.api_key, requests, args.concurrency))
    finally:
        if server is not None:
            from tests.entrypoints.serving import stop_server

            stop_server(server)
    print(report.summary())
    for line in (report.lost + report.invalid)[:20]:
        print("  ", line)
    return 1 if report.lost or report.invalid else 0


if __name__ == "__main__":
    raise SystemExit(main())
