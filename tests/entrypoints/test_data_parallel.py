"""Data-parallel replicas on this machine (``EngineGroup``: two real engines behind one client,
and the server's app over them): a shared prefix stays on one replica while load allows and is
served from its cache; concurrent requests spill to the other; a schema is compiled once
between the replicas; a replica whose engine dies fails its own requests in flight (503) while
the other serves, then comes back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from guidespec import SamplingParams
from guidespec.entrypoints.server import create_app
from guidespec.entrypoints.data_parallel import EngineGroup
from guidespec.llm import EngineDeadError
from guidespec.protocol import GuidedDecoding
from tests.entrypoints.replicas import SCHEMA, SYSTEM

pytestmark = pytest.mark.slow


def _wait(condition: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_replicas_share_prefixes_and_a_schema_and_outlive_a_dead_engine(tiny_base_model: Path) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    guided = SamplingParams(max_tokens=48, temperature=0.0, guided=GuidedDecoding(json_schema=json.dumps(SCHEMA)))
    with EngineGroup(
        2, str(tiny_base_model), max_batch_size=4, max_model_len=256, restart_on_failure=True, show_progress=False
    ) as group:
        assert group.config.grammar_cache_dir and Path(group.config.grammar_cache_dir).is_dir()
        # one after another, a shared prefix stays where it is cached
        outs = [group.generate(SYSTEM + f"Customer {i}: hello?", greedy)[0] for i in range(3)]
        home = outs[0].replica
        assert [o.replica for o in outs] == [home] * 3
        assert outs[0].stats.num_cached_tokens == 0
        assert all(o.stats.num_cached_tokens >= 16 * (len(SYSTEM) // 16) for o in outs[1:])
        # sent at once, they spill to the other replica past the load bound
        burst = group.generate([SYSTEM + f"Customer {i}: a helmet?" for i in range(6)], greedy)
        assert {o.replica for o in burst} == set(group.names)
        home = burst[-1].replica  # (both hold the prefix now: it goes where it was last sent)

        # a schema one replica compiled, the other loads from the shared folder
        first = group.generate("Order: two lights. JSON:", guided)[0]
        other = group.names.index(next(n for n in group.names if n != first.replica))
        second = group.engines[other].generate("Order: one helmet. JSON:", guided)[0]
        for out in (first, second):
            assert out.finish_reason == "stop"
            json.loads(out.text)
        _wait(lambda: (group.scheduler_stats.grammars_compiled, group.scheduler_stats.grammars_shared) == (1, 1))

        # the server's app over the group: which replica served, and the summed counters
        client = TestClient(create_app(group, "tiny"))
        reply = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": SYSTEM + "Customer 9: lights?", "max_tokens": 4}
        )
        assert reply.status_code == 200 and reply.headers["x-guidespec-replica"] == home
        metrics = client.get("/metrics").text
        assert "guidespec_grammars_compiled_total 1.0" in metrics and "guidespec_grammars_shared_total 1.0" in metrics

        # the home replica's engine dies under a request: that request fails (503), the other serves
        dead = group.names.index(home)

        async def in_flight_then_killed() -> str:
            long = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
            handle = group.open_stream(SYSTEM + "Customer 10: tell me everything.", long)
            deltas = handle.deltas()
            await deltas.__anext__()
            assert handle.output.replica == home
            os.kill(group.engines[dead]._processes.processes["scheduler"].pid, signal.SIGKILL)
            try:
                async for _ in deltas:
                    pass
            except EngineDeadError as e:
                return str(e)
            return "finished"

        assert asyncio.run(in_flight_then_killed()) != "finished"
        _wait(lambda: not group.engines[dead].is_healthy)
        served = group.generate(SYSTEM + "Customer 11: still there?", greedy)[0]
        assert served.replica != home and served.finish_reason == "length"
        # it comes back (restart_on_failure) and takes requests again: its caches were forgotten,
        # so a new prompt goes to the replica holding the least
        _wait(lambda: group.engines[dead].is_healthy, 90)
        back = group.generate("A new conversation about tandem bicycles and their brakes.", greedy)[0]
        assert back.replica == home and group.num_restarts == 1
