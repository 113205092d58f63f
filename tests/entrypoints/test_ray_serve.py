"""Data-parallel replicas on Ray Serve (``entrypoints/ray_serve.py``), on a local Ray cluster the test
starts (its own temporary folder, no authentication token of the user's): two engine replicas
behind the ingress serve the OpenAI client; requests sharing a prefix land on the same replica
while load allows; a schema is compiled once across the replicas; a killed replica gives 503s
while the other serves, and Ray Serve brings a fresh one back."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from tests.entrypoints.replicas import SCHEMA, SYSTEM

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def app_url(tiny_base_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from guidespec.entrypoints.ray_serve import build_app
    from tests.entrypoints.server.serving import free_port

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("RAY_AUTH_")}
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=100 * 2**20,
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
        logging_level="ERROR",
        log_to_driver=False,
    )
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        grammars = str(tmp_path_factory.mktemp("grammars"))  # (the replicas' shared compiled grammars)
        app = build_app(
            str(tiny_base_model), num_replicas=2, max_batch_size=4, max_model_len=256, grammar_cache_dir=grammars
        )
        serve.run(app, name="guidespec", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.update(saved)


def _complete(url: str, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": "tiny-base", "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _metric(url: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics", timeout=30).text, re.M)
    return float(found.group(1)) if found else -1.0


def _wait(condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_replicas_serve_route_by_prefix_share_a_schema_and_survive_a_killed_replica(app_url: str) -> None:
    client = openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused")
    # one after another, a shared prefix lands on one replica and is served from its cache
    replies = [
        client.completions.with_raw_response.create(
            model="tiny-base", prompt=SYSTEM + f"Customer {i}: hello?", max_tokens=8, temperature=0
        )
        for i in range(3)
    ]
    home = replies[0].headers["x-guidespec-replica"]
    assert [r.headers["x-guidespec-replica"] for r in replies] == [home] * 3
    assert all(r.parse().choices[0].text for r in replies)

    # a schema sent by eight at once: past the load bound (one past the mean in flight) they
    # spill to the other replica, which loads the schema the first compiled (or waits for it)
    # rather than compiling it again
    guided = {"response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}}}
    answers: list[httpx.Response] = []
    for burst in range(3):  # (a burst that finishes as fast as it arrives need not spill: again)
        threads = [
            threading.Thread(
                target=lambda i=i: answers.append(
                    _complete(app_url, SYSTEM + f"Order {burst}-{i}: JSON:", max_tokens=48, **guided)
                )
            )
            for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len({a.headers["x-guidespec-replica"] for a in answers}) == 2:
            break
    assert all(a.status_code == 200 for a in answers)
    for a in answers:
        json.loads(a.json()["choices"][0]["text"])
    assert len({a.headers["x-guidespec-replica"] for a in answers}) == 2
    # (each replica reports its counters every second or so)
    counters = ("guidespec_grammars_compiled_total", "guidespec_grammars_shared_total")
    _wait(lambda: [_metric(app_url, name) for name in counters] == [1, 1], 30)

    # the home replica's actor is killed under two requests: the one answered whole gets a 503
    # with Retry-After, the streamed one (its 200 sent) ends with an error event; the other
    # replica serves the next ones, and Ray Serve starts a fresh replica
    # (both replicas hold these blocks since the bursts spilled: a request goes to the one last sent
    # them, and the next one with them follows it there)
    prefix = SYSTEM[:64]
    body = {"model": "tiny-base", "prompt": prefix + "Tell me everything.", "max_tokens": 160, "ignore_eos": True}
    statuses: list[httpx.Response] = []
    with httpx.stream("POST", f"{app_url}/v1/completions", json={**body, "stream": True}, timeout=120) as streamed:
        home = streamed.headers["x-guidespec-replica"]
        events = streamed.iter_lines()
        assert next(events).startswith("data: ")
        whole = threading.Thread(
            target=lambda: statuses.append(httpx.post(f"{app_url}/v1/completions", json=body, timeout=120))
        )
        whole.start()
        time.sleep(0.15)
        ray.kill(ray.get_actor(home, namespace="serve"), no_restart=True)
        rest = list(events)
    whole.join()
    # (the whole answer races the kill: routed to the home replica first, it gets a 503 with
    # Retry-After; routed after Ray Serve saw the death, the survivor serves it)
    answer = statuses[0]
    if answer.status_code == 503:
        assert answer.headers["retry-after"], answer.text
    else:
        assert answer.status_code == 200 and answer.headers["x-guidespec-replica"] != home, answer.text
    assert "data: [DONE]" not in rest and any('"error"' in line for line in rest)
    for i in range(3):
        after = _complete(app_url, SYSTEM + f"Customer {20 + i}: still there?")
        assert after.status_code == 200 and after.headers["x-guidespec-replica"] != home

    def two_replicas_again() -> bool:
        replicas = serve.status().applications["guidespec"].deployments["GuidespecEngine"].replica_states
        return replicas.get("RUNNING", 0) == 2

    _wait(two_replicas_again, 120)
    # the fresh replica takes requests once the ingress's router learns of it: a new prompt goes
    # to the replica holding the least
    survivor = after.headers["x-guidespec-replica"]
    fresh = ""
    deadline = time.monotonic() + 60
    while not fresh:
        assert time.monotonic() < deadline, "the fresh replica took no request"
        # (a prompt whose first block no replica holds: the replica holding the least takes it)
        reply = _complete(app_url, f"{uuid.uuid4().hex} is a new conversation about tandem bicycles.")
        assert reply.status_code == 200
        fresh = reply.headers["x-guidespec-replica"] if reply.headers["x-guidespec-replica"] != survivor else ""
        time.sleep(0.2)
    assert fresh != home


def test_serve_runs_app_builder_takes_typed_key_values(tiny_base_model: Path) -> None:
    """``serve run guidespec.entrypoints.ray_serve:app_builder key=value ...``: values typed as the
    arguments' defaults, the engine's arguments checked before anything is deployed."""
    from guidespec.entrypoints.ray_serve import _typed, app_builder

    assert _typed("4", 16) == 4 and _typed("0.5", 0.9) == 0.5 and _typed("false", True) is False
    assert _typed("round_robin", "cache_aware") == "round_robin" and _typed("256", None) == 256
    assert _typed("ngram", None) == "ngram" and _typed("none", None) is None
    app = app_builder({"model": str(tiny_base_model), "num_replicas": "3", "max_batch_size": "4"})
    assert type(app).__name__ == "Application"
    with pytest.raises(ValueError, match="unknown argument 'max_batch'"):
        app_builder({"model": str(tiny_base_model), "max_batch": "4"})
    with pytest.raises(ValueError, match="max_batch_size"):
        app_builder({"model": str(tiny_base_model), "max_batch_size": "0"})
