"""TP=2 with every rank a Ray actor, on a real local Ray cluster (``ray start --head`` on
127.0.0.1, stopped by the test): the same greedy output as TP=2 under the plain launcher; a
placement the cluster cannot hold fails with a message saying so."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from guidespec import LLM, SamplingParams
from guidespec.launch.sweep import validate_output
from guidespec.protocol import GuidedDecoding

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
WORKLOAD = Path(__file__).resolve().parents[3] / "shared" / "data" / "jsonschemabench" / "workload.jsonl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    port = _free_port()
    temp = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([ray_cli, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                    "--num-cpus", "2", "--include-dashboard", "false", "--object-store-memory", str(100 * 2**20),
                    "--temp-dir", str(temp), "--disable-usage-stats"], check=True, env=env, capture_output=True)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True)


def _requests() -> list[tuple[object, SamplingParams]]:
    case = next(json.loads(line) for line in WORKLOAD.read_text().splitlines() if line.startswith('{"id": "JME_'))
    return [("Count from one to ten in words:", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
            (case["messages"], SamplingParams(max_tokens=120, temperature=0.0,
                                              guided=GuidedDecoding(json_schema=case["schema"])))]


def _generate(llm: LLM) -> list[list[int]]:
    return [llm.generate(prompt, params)[0].token_ids for prompt, params in _requests()]


def test_tensor_parallel_under_ray_equals_the_plain_launcher(cluster: str) -> None:
    with LLM(tensor_parallel_size=2, show_progress=False) as llm:
        plain = _generate(llm)
    with LLM(tensor_parallel_size=2, show_progress=False, distributed_executor="ray", ray_address=cluster) as llm:
        assert llm.config.distributed_executor == "ray"
        under_ray = _generate(llm)
        guided_text = llm.generate(*_requests()[1])[0].text
    assert under_ray == plain
    case = next(json.loads(line) for line in WORKLOAD.read_text().splitlines() if line.startswith('{"id": "JME_'))
    assert validate_output(guided_text, case["schema"]) is None


def test_a_placement_the_cluster_cannot_hold_fails_clearly(cluster: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUIDESPEC_WORKER_THREADS", "2")  # 2 ranks x 2 CPUs on a 2-CPU cluster
    with pytest.raises(RuntimeError, match="cannot hold the placement: 2 ranks x 2 CPU need 4 CPUs, the cluster has 2"):
        LLM(tensor_parallel_size=2, show_progress=False, distributed_executor="ray", ray_address=cluster)
