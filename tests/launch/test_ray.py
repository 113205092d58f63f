"""TP=2 with every rank a Ray actor, on a real local Ray cluster (``ray start --head`` on
127.0.0.1 with token authentication on, under a token the test makes; stopped by the test): the
same greedy output as TP=2 under the plain launcher; a placement the cluster cannot hold fails
with a message saying so; the executor finds the token where Ray looks for it, and a missing or
wrong one fails at once saying what to set. Neither the cluster nor the driver reads the user's
``~/.ray/auth_token`` or ``RAY_AUTH_*`` settings."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from guidespec import LLM, SamplingParams
from guidespec.llm import GenerationOutput
from guidespec.launch.ray_executor import RayRanks
from guidespec.entrypoints.sweep import validate_output
from guidespec.protocol import GuidedDecoding

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
WORKLOAD = Path(__file__).resolve().parents[3] / "shared" / "data" / "jsonschemabench" / "workload.jsonl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Cluster:
    address: str
    token: str


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The cluster's token is given outright (RAY_AUTH_MODE, RAY_AUTH_TOKEN): ``ray start`` would
    otherwise turn authentication on or off by whether ``~/.ray/auth_token`` exists (issue 21)."""
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    port = _free_port()
    temp = tmp_path_factory.mktemp("ray")
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    subprocess.run(
        [
            ray_cli,
            "start",
            "--head",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-cpus",
            "2",
            "--include-dashboard",
            "false",
            "--object-store-memory",
            str(100 * 2**20),
            "--temp-dir",
            str(temp),
            "--disable-usage-stats",
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    try:
        yield Cluster(f"127.0.0.1:{port}", token)
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True)


@pytest.fixture
def address(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> str:
    """The cluster's address, the driver holding its token as a user would: in RAY_AUTH_TOKEN
    (which Ray prefers to any token file), RAY_AUTH_MODE left unset."""
    _clear_ray_auth_settings(monkeypatch)
    monkeypatch.setenv("RAY_AUTH_TOKEN", cluster.token)
    return cluster.address


def _requests() -> list[tuple[Any, SamplingParams]]:
    case = next(json.loads(line) for line in WORKLOAD.read_text().splitlines() if line.startswith('{"id": "JME_'))
    return [
        ("Count from one to ten in words:", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
        (
            case["messages"],
            SamplingParams(max_tokens=120, temperature=0.0, guided=GuidedDecoding(json_schema=case["schema"])),
        ),
    ]


def _generate(llm: LLM) -> list[GenerationOutput]:
    return [llm.generate(prompt, params)[0] for prompt, params in _requests()]


def test_tensor_parallel_under_ray_equals_the_plain_launcher(address: str) -> None:
    with LLM(tensor_parallel_size=2, show_progress=False) as llm:
        plain = _generate(llm)
    with LLM(tensor_parallel_size=2, show_progress=False, distributed_executor="ray", ray_address=address) as llm:
        assert llm.config.distributed_executor == "ray"
        under_ray = _generate(llm)
    assert [o.token_ids for o in under_ray] == [o.token_ids for o in plain]
    guided_text = under_ray[1].text
    case = next(json.loads(line) for line in WORKLOAD.read_text().splitlines() if line.startswith('{"id": "JME_'))
    assert validate_output(guided_text, case["schema"]) is None


def test_a_placement_the_cluster_cannot_hold_fails_clearly(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUIDESPEC_WORKER_THREADS", "2")  # 2 ranks x 2 CPUs on a 2-CPU cluster
    with pytest.raises(RuntimeError, match="cannot hold the placement: 2 ranks x 2 CPU need 4 CPUs, the cluster has 2"):
        LLM(tensor_parallel_size=2, show_progress=False, distributed_executor="ray", ray_address=address)


def test_joins_with_the_token_in_the_default_file(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _clear_ray_auth_settings(monkeypatch)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(cluster.token)
    ranks = RayRanks(num_ranks=1, num_cpus=1, address=cluster.address, placement_timeout_s=30)
    try:
        assert ray.cluster_resources().get("CPU") == 2.0
    finally:
        ranks.close()
    assert not ray.is_initialized() and "RAY_AUTH_MODE" not in os.environ  # the process's own setting is back


@pytest.mark.parametrize(
    "settings, error",
    [
        ({}, "requires token authentication and no token was found here: set RAY_AUTH_TOKEN"),
        (
            {"RAY_AUTH_TOKEN": "not-the-token"},
            "rejected the authentication token from RAY_AUTH_TOKEN: set RAY_AUTH_TOKEN",
        ),
        ({"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "{token}"}, "RAY_AUTH_MODE=disabled here turns it off"),
        ({"RAY_AUTH_MODE": "token"}, "is joined with RAY_AUTH_MODE=token and no token was found here"),
    ],
    ids=["no-token", "wrong-token", "auth-off", "token-mode-without-token"],
)
def test_joining_without_the_right_token_fails_clearly(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, settings: dict[str, str], error: str
) -> None:
    _clear_ray_auth_settings(monkeypatch)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    for name, value in settings.items():
        monkeypatch.setenv(name, value.format(token=cluster.token))
    with pytest.raises(RuntimeError, match=error):
        RayRanks(num_ranks=1, num_cpus=1, address=cluster.address, placement_timeout_s=30)
    assert not ray.is_initialized() and os.environ.get("RAY_AUTH_MODE") == settings.get("RAY_AUTH_MODE")


def _clear_ray_auth_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
