"""Worker ranks as Ray actors (``distributed_executor="ray"``), one per bundle of a placement group.

The scheduler stays a local process beside the client; every rank is a ``RayRank`` actor placed
in bundle ``rank`` of a placement group (one bundle of ``num_cpus`` CPUs — or one GPU — per
rank, on any node: ``PACK`` where they fit). The ranks read the step broadcast over the signed
ZeroMQ TCP stream (``ipc/remote.py``) and send results to a TCP endpoint the scheduler binds, on
the driver node's address; torch.distributed rendezvouses at rank 0's node. A cluster that
cannot hold the placement fails at once with what it has and what it needs (or after
``placement_timeout_s`` when resources are busy). The model folder must exist at the same path
on every node.

Joining a cluster that uses Ray's token authentication (``ray start`` turns it on when it finds
a token, e.g. ``~/.ray/auth_token``): ``ray.init(address=...)`` sends none unless
``RAY_AUTH_MODE=token`` is set, so before joining the executor asks the cluster's GCS whether it
takes this process unauthenticated and, when it does not, joins in token mode with the token Ray
finds here (``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH`` names, else
``~/.ray/auth_token``), or fails at once saying which of these to set. It does not create or copy
tokens.

Ray is imported only here, only when this executor is chosen.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

from guidespec.config import WorkerConfig, config_from_dict


PLACEMENTS = ("pack", "spread")


def placement_bundle(num_cpus: int, num_gpus: int) -> dict[str, float]:
    """One rank's resources: its CPUs, and its GPU on a CUDA engine."""
    return {"CPU": float(num_cpus), **({"GPU": float(num_gpus)} if num_gpus else {})}


def placement_strategy(placement: str, num_gpus: int) -> str:
    """GPU ranks: ``STRICT_PACK`` (one node: NCCL over NVLink / PCIe) or ``STRICT_SPREAD``; CPU
    ranks: ``PACK`` or ``SPREAD`` (best effort, as before)."""
    if num_gpus:
        return "STRICT_PACK" if placement == "pack" else "STRICT_SPREAD"
    return "PACK" if placement == "pack" else "SPREAD"


def placement_problem(num_ranks: int, bundle: dict[str, float], cluster: dict[str, float]) -> str | None:
    """Why a cluster with ``cluster`` resources can never hold ``num_ranks`` bundles, or None."""
    for resource, amount in bundle.items():
        have, need = cluster.get(resource, 0.0), num_ranks * amount
        if have < need:
            hint = (
                "add GPU nodes, or lower tensor_parallel_size"
                if resource == "GPU"
                else "add nodes, lower tensor_parallel_size, or GUIDESPEC_WORKER_THREADS for fewer CPUs per rank"
            )
            return (
                f"the Ray cluster cannot hold the placement: {num_ranks} ranks x {amount:g} {resource} need "
                f"{need:g} {resource}s, the cluster has {have:g} ({hint})"
            )
    return None


def _describe(resources: dict[str, float]) -> str:
    return " + ".join(f"{amount:g} {name}" for name, amount in resources.items())


class RayRank:
    """One worker rank inside a Ray actor; ``run`` is its whole life (``worker.run_worker``)."""

    def node_address(self) -> tuple[str, int]:
        """This node's address and a free TCP port on it (for torch.distributed's rendezvous)."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return ip, int(s.getsockname()[1])

    def run(self, config_json: str) -> str:
        from guidespec.worker.worker import run_worker

        cfg = config_from_dict(WorkerConfig, json.loads(config_json))
        run_worker(cfg, os.getppid())  # the actor's parent (Ray's worker process) stands for the client
        return f"rank {cfg.rank} done"


class RayRanks:
    """The placement group and the rank actors of one engine."""

    def __init__(
        self,
        num_ranks: int,
        num_cpus: int,
        address: str | None,
        placement_timeout_s: float,
        num_gpus: int = 0,
        placement: str = "pack",
    ) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"ray placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ImportError("distributed_executor='ray' needs Ray: pip install 'ray>=2.9'") from None
        self._ray = ray
        self._remove_pg = remove_placement_group
        self.started_ray = not ray.is_initialized()
        self._undo_auth: Callable[[], None] = _keep_auth
        if self.started_ray:
            self._undo_auth = join_cluster(address)
        self.refs: list[Any] = []
        self.actors: list[Any] = []
        bundle = placement_bundle(num_cpus, num_gpus)
        problem = placement_problem(num_ranks, bundle, ray.cluster_resources())
        if problem is not None:
            self.close()
            raise RuntimeError(problem)
        strategy = placement_strategy(placement, num_gpus)
        self.pg = placement_group([bundle] * num_ranks, strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=placement_timeout_s)
        except Exception:
            free = {k: ray.available_resources().get(k, 0.0) for k in bundle}
            self.close()
            where = (
                " on one node" if strategy == "STRICT_PACK" else (" on distinct nodes" if "SPREAD" in strategy else "")
            )
            raise RuntimeError(
                f"the Ray cluster could not place {num_ranks} ranks x {_describe(bundle)}{where} within "
                f"{placement_timeout_s:g} s ({_describe(free)} free now)"
            ) from None
        actor_cls = ray.remote(RayRank)
        self.actors = [
            actor_cls.options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(num_ranks)
        ]

    def driver_address(self) -> str:
        return str(self._ray.util.get_node_ip_address())

    def rank0_rendezvous(self) -> str:
        ip, port = self._ray.get(self.actors[0].node_address.remote(), timeout=60)
        return f"tcp://{ip}:{port}"

    def start(self, configs: list[WorkerConfig]) -> None:
        from guidespec.config import config_to_dict

        self.refs = [actor.run.remote(json.dumps(config_to_dict(cfg))) for actor, cfg in zip(self.actors, configs)]

    def first_dead(self) -> str | None:
        if not self.refs:
            return None
        done, _ = self._ray.wait(self.refs, num_returns=1, timeout=0)
        if not done:
            return None
        rank = self.refs.index(done[0])
        try:
            how = self._ray.get(done[0], timeout=1)
        except Exception as e:
            how = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return f"worker rank {rank} (Ray actor) stopped: {how}"

    def close(self, grace_s: float = 3.0) -> None:
        ray = self._ray
        if self.refs:
            deadline = time.monotonic() + grace_s
            ray.wait(self.refs, num_returns=len(self.refs), timeout=max(0.0, deadline - time.monotonic()))
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
        self.actors, self.refs = [], []
        if getattr(self, "pg", None) is not None:
            try:
                self._remove_pg(self.pg)
            except Exception:
                pass
            self.pg = None
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
        self._undo_auth()
        self._undo_auth = _keep_auth


_TOKEN_HELP = (
    "set RAY_AUTH_TOKEN to the cluster's token (or RAY_AUTH_TOKEN_PATH to a file holding it, or put it "
    "in ~/.ray/auth_token); `ray get-auth-token` on the head node prints it"
)


def join_cluster(address: str | None, **init_kwargs: Any) -> Callable[[], None]:
    """``ray.init`` this process into the cluster at ``address`` (None: the current or a new
    local one), in the authentication mode it expects, passing on the ``GUIDESPEC_`` settings;
    returns what undoes the authentication settings (at shutdown)."""
    import ray

    undo = _adopt_cluster_auth(address)
    try:
        ray.init(
            address=address,
            logging_level=logging.WARNING,
            log_to_driver=False,
            runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("GUIDESPEC_")}},
            **init_kwargs,
        )
    except BaseException:
        undo()
        raise
    return undo


def _adopt_cluster_auth(address: str | None) -> Callable[[], None]:
    """Make this process speak the authentication the cluster at ``address`` expects, before
    ``ray.init`` joins it; returns what undoes that (at ``close``). Ray itself only guesses token
    mode for an automatically found local cluster; an explicit address gets none, and the join
    then retries for ~30 s and ends in "Failed to connect to Ray cluster"."""
    if not address or "://" in address or address in ("auto", "local"):
        return _keep_auth  # a new local cluster or one Ray finds itself: Ray decides (ray:// is Ray Client)
    try:
        from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]
    except ImportError:
        return _keep_auth  # a Ray without token authentication
    mode = os.environ.get("RAY_AUTH_MODE")  # Ray's own setting, passed through as it is
    _set_auth_mode(mode)  # Ray caches its config at import; read the environment as it is now
    undo = _keep_auth
    if (mode or "").lower() != "token":
        if _gcs_answer(address) != "rejected":
            return _keep_auth  # open, or unreachable (ray.init says so as before)
        if mode is not None:
            raise RuntimeError(
                f"the Ray cluster at {address} requires token authentication, but RAY_AUTH_MODE={mode} "
                f"here turns it off: unset RAY_AUTH_MODE (or set it to token) and {_TOKEN_HELP}"
            )
        undo = _restore_auth_mode
    if not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        why = "requires token authentication" if mode is None else f"is joined with RAY_AUTH_MODE={mode}"
        raise RuntimeError(f"the Ray cluster at {address} {why} and no token was found here: {_TOKEN_HELP}")
    _set_auth_mode("token")  # Ray's core worker asserts a token exists in token mode: checked above
    if _gcs_answer(address) == "rejected":
        undo()
        raise RuntimeError(
            f"the Ray cluster at {address} rejected the authentication token from {_token_source()}: {_TOKEN_HELP}"
        )
    return undo


def _gcs_answer(address: str) -> str:
    """``accepted``, ``rejected`` (by token authentication) or ``unreachable``: one GCS client
    made under this process's current auth mode (an answer takes milliseconds; no answer ~12 s)."""
    from ray._raylet import InnerGcsClient  # type: ignore[attr-defined]
    from ray.exceptions import AuthenticationError

    try:
        InnerGcsClient.standalone(address, None, 2000)
    except AuthenticationError:
        return "rejected"
    except Exception:
        return "unreachable"
    return "accepted"


def _set_auth_mode(mode: str | None) -> None:
    """Ray reads ``RAY_AUTH_MODE`` only from the environment (``ray.init`` refuses it in
    ``_system_config``) and caches it, and the token, in C++: refresh both, config first (as Ray's
    own tests do, so no thread reloads a token under a stale mode)."""
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    if mode is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = mode
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _restore_auth_mode() -> None:
    _set_auth_mode(None)


def _keep_auth() -> None:
    pass


def _token_source() -> str:
    """Where Ray took the token from, in the order its loader looks."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"RAY_AUTH_TOKEN_PATH ({os.environ['RAY_AUTH_TOKEN_PATH']})"
    return str(Path.home() / ".ray" / "auth_token")
