"""The server tried as an attacker and as an operator would (issue 21's findings, each a
regression test): hostile fields get a 4xx with an error body and never reach a worker; a
worker killed mid-generation answers every request in flight with a 503 within 2 s, and a fresh
engine serves within 60 s with nothing of the dead one left (processes, shared memory, ipc
files); a crash loop exits non-zero; a small mixed load loses nothing; SIGTERM drains.

The module's server is stopped by its last test (SIGTERM): keep that test last.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from benchmarks.load import build_requests, load_cases, run_load
from tests.entrypoints.server.serving import (
    AUTH,
    KEY,
    Server,
    alive,
    engine_processes,
    healthy,
    shared_files,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "Give me a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    running = start_server("--max-batch-size", "8", "--speculative", "ngram")
    try:
        yield running
    finally:
        stop_server(running)


def _post(server: Server, body: dict[str, Any], path: str = "/v1/chat/completions", **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=120, **kwargs)


def _assert_refused(response: httpx.Response, statuses: tuple[int, ...] = (400,), match: str = "") -> None:
    assert response.status_code in statuses, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == response.status_code and match in error["message"], error
    assert "Traceback" not in response.text and 'File "' not in response.text


def test_an_out_of_vocabulary_prompt_is_a_400_and_the_engine_serves_on(server: Server) -> None:
    _assert_refused(_post(server, {"prompt": [60000, 1, 2], "max_tokens": 4}, "/v1/completions"), match="[0, 49152)")
    assert healthy(server.url)
    assert _post(server, {"prompt": [1, 2, 3], "max_tokens": 4}, "/v1/completions").status_code == 200


def test_a_token_id_past_int32_is_a_400(server: Server) -> None:
    _assert_refused(
        _post(server, {"prompt": [27070147699068784], "max_tokens": 4}, "/v1/completions"), match="vocabulary"
    )


HOSTILE = {
    "max_tokens past int64": {"max_tokens": 10**30},
    "top_k past int32": {"top_k": 2**40},
    "seed past int64": {"seed": 2**70},
    "temperature huge": {"temperature": 1e300},
    "repetition penalty 0": {"repetition_penalty": 0},
    "frequency penalty huge": {"frequency_penalty": 1e9},
    "a thousand stop strings": {"stop": ["x"] * 1000},
    "a stop string of 100k characters": {"stop": ["x" * 100_000]},
    "a schema nested 5000 deep": {"guided_json": "[" * 5000 + "]" * 5000},
    "a schema nested 200 deep": {"guided_json": json.dumps(json.loads('{"a":' * 200 + "1" + "}" * 200))},
    "a 2 MB schema": {"guided_json": {"type": "object", "description": "x" * (2 << 20)}},
    "5000 choices": {"guided_choice": [f"c{i}" for i in range(5000)]},
    "a regex of 100k characters": {"guided_regex": "a" * 100_000},
    "response_format's json_schema a string": {"response_format": {"type": "json_schema", "json_schema": "x"}},
    "logit_bias": {"logit_bias": {"1": 100}},
    "an unknown backend": {"guided_json": {"type": "object"}, "guided_decoding_backend": "outlines"},
    "a role that is not one": {"messages": [{"role": "wizard", "content": "hi"}]},
    "content of the wrong type": {"messages": [{"role": "user", "content": 5}]},
    "n of a million": {"n": 10**6},
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_fields_get_a_4xx_with_an_error_body(server: Server, name: str) -> None:
    _assert_refused(_post(server, {"messages": ASK, "max_tokens": 4, **HOSTILE[name]}), (400, 413, 422))


def test_a_body_past_the_limit_is_a_413_and_a_nan_a_400(server: Server) -> None:
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (17 << 20) + b'"}]}'
    _assert_refused(
        httpx.post(
            f"{server.url}/v1/chat/completions",
            content=big,
            timeout=60,
            headers={**AUTH, "Content-Type": "application/json"},
        ),
        (413,),
    )
    nan = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    _assert_refused(
        httpx.post(
            f"{server.url}/v1/chat/completions",
            content=nan,
            timeout=60,
            headers={**AUTH, "Content-Type": "application/json"},
        ),
        (400, 422),
    )
    assert healthy(server.url)


def test_extreme_but_valid_values_are_served(server: Server) -> None:
    """Values at the edges of the ranges reach the workers and must not break their maths."""
    for extreme in (
        {"temperature": 1e-30},
        {"top_p": 1e-30},
        {"top_k": 2**31 - 1},
        {"temperature": 100},
        {"repetition_penalty": 1e4},
        {"repetition_penalty": 1e-4},
        {"seed": 2**63 - 1},
        {"frequency_penalty": -2, "presence_penalty": 2},
    ):
        response = _post(server, {"messages": ASK, "max_tokens": 3, **extreme})
        assert response.status_code == 200, (extreme, response.text[:300])


def test_a_grammar_the_vocabulary_cannot_follow_fails_alone(server: Server) -> None:
    """Found by schemathesis: a regex of characters no token spells left a logits row with no
    allowed token, and the worker's sampler died on it."""
    response = _post(
        server,
        {
            "prompt": "PW",
            "max_tokens": 8,
            "top_k": 21573013,
            "guided_regex": "\U00050557\u0083\u00f8\u0090\u00d1\U000b6cf3y",
        },
        "/v1/completions",
    )
    assert response.status_code in (200, 400), response.text[:300]
    assert "Traceback" not in response.text
    assert healthy(server.url)


def test_a_small_mixed_load_loses_nothing(server: Server) -> None:
    """The 500-request run is ``benchmarks/load.py``; this one is the same code, smaller."""
    requests = build_requests(32, max_tokens=32, cases=load_cases("JME_", limit=8))
    report = asyncio.run(run_load(server.url, KEY, requests, concurrency=32))
    print(report.summary())
    assert report.lost == [] and report.invalid == []
    assert sum(report.outcomes.values()) == 32 and report.finish_reasons


def _inflight(server: Server, stream: bool, outcome: list[tuple[float, int]]) -> None:
    """A long request; records (when it ended, its status or its stream's error code)."""
    body = {"messages": ASK, "max_tokens": 1500, "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=120, headers=AUTH) as http:
        if not stream:
            response = http.post(f"{server.url}/v1/chat/completions", json=body)
            outcome.append((time.monotonic(), response.status_code))
            return
        with http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                # parsed, not matched: a delta whose content is the token "error" is no error event
                event = json.loads(line.removeprefix("data: ")) if line.startswith("data: {") else {}
                if "error" in event:
                    outcome.append((time.monotonic(), event["error"]["code"]))
                    return
        outcome.append((time.monotonic(), response.status_code))


def _kill_worker_under_load(server: Server) -> tuple[list[tuple[float, int]], float, dict[int, str], set[str]]:
    """Four requests in flight (two streamed), then SIGKILL to worker rank 0: (outcomes, kill time,
    the engine's processes before, the shared files before)."""
    before, files = engine_processes(server.process.pid), shared_files()
    outcomes: list[tuple[float, int]] = []
    threads = [threading.Thread(target=_inflight, args=(server, i % 2 == 0, outcomes)) for i in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(3.0)  # all four admitted and generating
    worker = next(pid for pid, name in before.items() if name == "gs-worker0")
    os.kill(worker, signal.SIGKILL)
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(timeout=30)
    return outcomes, killed_at, before, files


def _wait_healthy(server: Server, timeout_s: float = 60.0) -> float:
    start = time.monotonic()
    while not healthy(server.url):
        assert time.monotonic() - start < timeout_s, f"no serving engine within {timeout_s:.0f} s"
        time.sleep(0.1)
    return time.monotonic() - start


def test_a_killed_worker_gives_503s_within_2s_and_a_fresh_engine_within_60s(server: Server) -> None:
    outcomes, killed_at, before, files = _kill_worker_under_load(server)
    assert [code for _, code in outcomes] == [503] * 4
    assert max(t for t, _ in outcomes) - killed_at < 2.0
    restarting = httpx.get(f"{server.url}/health", timeout=5)
    if restarting.status_code == 503:  # (a fast restart may be done already)
        assert int(restarting.headers["retry-after"]) > 0
        during = _post(server, {"messages": ASK, "max_tokens": 4})
        assert during.status_code == 200 or (during.status_code == 503 and "retry-after" in during.headers)
    _wait_healthy(server)
    assert _post(server, {"messages": ASK, "max_tokens": 4}).status_code == 200
    after = engine_processes(server.process.pid)
    assert not [before[pid] for pid in before if alive(pid)], f"a process of the dead engine is still running: {before}"
    assert sorted(after.values()) == sorted(before.values())  # a fresh scheduler, worker, compile process
    gone, new = files - shared_files(), shared_files() - files
    assert len(gone) == len(new) == 5, (gone, new)  # the ring, the mask arena, three ipc sockets: replaced
    metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
    assert "guidespec_engine_restarts_total 1.0" in metrics


def test_sigterm_drains_in_flight_requests_then_stops_everything(server: Server) -> None:
    """The module's last test: it stops the server."""
    _wait_healthy(server)  # (an earlier test's restart may still be going on)
    processes, files = engine_processes(server.process.pid), shared_files()
    body = {"messages": ASK, "max_tokens": 40, "ignore_eos": True, "stream": True, "temperature": 0}
    events: list[str] = []

    def stream() -> None:
        with httpx.Client(timeout=120, headers=AUTH) as http:
            with http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
                events.extend(line for line in response.iter_lines() if line.startswith("data: "))

    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(1.5)
    server.process.send_signal(signal.SIGTERM)
    thread.join(timeout=60)
    assert server.process.wait(timeout=60) == 0
    assert events[-1] == "data: [DONE]" and not any("error" in json.loads(e[6:]) for e in events[:-1])
    finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e[6:])["choices"]]
    assert finish[-1] == "length"
    assert not [pid for pid in processes if alive(pid)]
    assert len(files - shared_files()) == 5 and not shared_files() - files  # its ring, arena, ipc sockets: gone


def test_a_crash_loop_exits_non_zero_for_the_supervisor(tiny_base_model: Path) -> None:
    """Three deaths within a minute: no more restarts, the server exits non-zero, leaving nothing.
    (The supervisor's part: a tiny random model serves, its engines start in a fraction of the time.)"""
    files = shared_files()
    crashing = start_server("--model", str(tiny_base_model), "--max-model-len", "64", "--max-batch-size", "2")
    killed: list[int] = []
    try:
        while crashing.process.poll() is None and len(killed) < 3:
            workers = [
                pid
                for pid, name in engine_processes(crashing.process.pid).items()
                if name == "gs-worker0" and pid not in killed
            ]
            if workers and healthy(crashing.url):  # the engine of the last kill has been replaced
                os.kill(workers[0], signal.SIGKILL)
                killed.append(workers[0])
            time.sleep(0.1)
        code = crashing.process.wait(timeout=60)
    finally:
        stop_server(crashing)
    assert len(killed) == 3 and code == 1
    assert "crash loop" in crashing.log()
    assert not shared_files() - files
