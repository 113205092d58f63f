"""Data-parallel replicas on a Ray cluster: a Ray Serve application of N guidespec engines
behind one OpenAI-compatible ingress (``guidespec serve --data-parallel-size N
--distributed-executor ray``, or ``serve run guidespec.entrypoints.ray_serve:app_builder``).

- ``EngineReplica`` (deployment ``GuidespecEngine``, N replicas): one engine (an ``LLM``: its
  scheduler and its tensor-parallel ranks as processes beside it), placed with a placement
  group bundle of its own that holds them all (``tensor_parallel_size`` x ``cpus_per_rank``
  CPUs, or one GPU per rank). It restarts its own engine after a death; when the engine gives
  up, its health check fails and Ray Serve replaces the replica.
- ``Ingress`` (deployment ``GuidespecIngress``): the same FastAPI app as ``guidespec serve``
  (routes, errors, metrics) over ``ReplicaClient``, which tokenizes and checks each request as an
  ``LLM`` does, then streams it from a replica through a deployment handle.
- ``CacheAwareRequestRouter``: Ray Serve's request router interface around ``routing``'s
  policy: a request goes to the replica that holds its prompt's prefix and its grammar, bounded
  by load (this router's requests in flight on each replica).
- The replicas share compiled grammars through a folder (``grammar_cache_dir``): a schema is
  compiled once per node, or once per cluster where the folder is on a shared filesystem.

Faults: a replica whose engine dies fails its requests in flight with 503 (``Retry-After``), as
one engine does; the ingress stops sending to it at once (a request refused by a replica that is
restarting goes to another before any token of it has gone out), and the router forgets its
caches. A replica whose actor dies (or whose node is lost) is replaced by Ray Serve; meanwhile
the others serve. Shutdown (SIGTERM or Ctrl-C of ``guidespec serve``; ``serve.delete("guidespec")``
for an app started otherwise) drains every replica: requests in flight finish, then each engine
stops. (``serve shutdown`` / ``serve.shutdown()`` alone stops Ray Serve's HTTP proxy at once and
drops the requests in flight.)

Everything between the ingress and the replicas stays inside the cluster (Ray's own
serialization, as with any Ray Serve application); clients reach only the ingress's HTTP routes.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections import Counter
from typing import Any, AsyncIterator, Callable

from guidespec.config import EngineConfig
from guidespec.launch import routing as routing_module  # (its BOARD: see routing.Board)
from guidespec.launch.routing import (
    DEFAULT_BALANCE,
    ROUTING_POLICIES,
    CacheAwareRouter,
    check_balance,
    grammar_key_of,
    make_router,
)
from guidespec.llm import (
    LLM,
    EngineDeadError,
    EngineRestartingError,
    GenerationOutput,
    RequestError,
    RequestHandle,
    StreamDelta,
)
from guidespec.prompts import Prompt, PromptEncoder, load_chat_template
from guidespec.protocol import (
    ENGINE_UNAVAILABLE,
    DecodeStats,
    InvalidRequest,
    SamplingParams,
    SchedulerStats,
    validate_request,
)

logger = logging.getLogger("guidespec.ray_serve")

ENGINE_DEPLOYMENT = "GuidespecEngine"
INGRESS_DEPLOYMENT = "GuidespecIngress"
UNAVAILABLE_S = 5.0  # how long the ingress sends nothing to a replica that said its engine is down
STATS_PERIOD_S = 1.0  # how often each replica reports its figures (queues, KV use, grammars) to the routers


# ---------------------------------------------------------------------- the replicas


class EngineReplica:
    """One engine; ``generate`` streams one request's deltas as plain dicts."""

    def __init__(self, model: str | None, llm_kwargs: dict[str, Any]) -> None:
        from ray import serve

        self.name = serve.get_replica_context().replica_id.to_full_id_str()
        os.makedirs(llm_kwargs["grammar_cache_dir"], mode=0o700, exist_ok=True)
        self.llm = LLM(model, restart_on_failure=True, **llm_kwargs)

    async def generate(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """``payload``: ``prompt_token_ids``, ``params`` (a ``SamplingParams``), ``stream``. Each item
        is a delta (``text``, ``token_ids``, ``finished``, ...) or, once, an ``error`` with its
        ``status``; every item names this replica."""
        try:
            handle = self.llm.open_stream(
                {"prompt_token_ids": payload["prompt_token_ids"]}, payload["params"], stream=payload["stream"]
            )
        except InvalidRequest as e:
            yield self._error(str(e), 400, param=e.param)
            return
        except (ValueError, TypeError) as e:
            yield self._error(str(e), 400)
            return
        except EngineDeadError as e:
            yield self._error(str(e), ENGINE_UNAVAILABLE, unavailable=True)
            return
        deltas = handle.deltas()
        out = handle.output
        try:
            async for delta in deltas:
                item: dict[str, Any] = {
                    "replica": self.name,
                    "text": delta.text,
                    "token_ids": delta.token_ids,
                    "finished": delta.finished,
                    "finish_reason": delta.finish_reason,
                    "first_token_time": out.first_token_time,
                    "grammar_backend": out.grammar_backend,
                    "grammar_refusal": out.grammar_refusal,
                }
                if delta.finished:
                    item["stats"] = dataclasses.asdict(out.stats)
                yield item
        except RequestError as e:
            yield self._error(str(e), e.status, code=e.code)
        except EngineDeadError as e:
            yield self._error(str(e), ENGINE_UNAVAILABLE)
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]  # (a cancelled request is aborted)

    def engine_pids(self) -> dict[str, int]:
        """The engine's processes by name (``scheduler``, ``worker0``, ...): for operators and tests."""
        return {name: process.pid for name, process in self.llm._processes.processes.items()}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine gave up (a crash loop) is replaced."""
        if self.llm.gave_up:
            raise RuntimeError("the engine died in a crash loop")

    def record_routing_stats(self) -> dict[str, Any]:
        """What the routers see of this replica (``STATS_PERIOD_S``): its queues, KV cache and
        grammar counters, restarts, and whether its engine serves."""
        return {
            "replica": self.name,
            "stats": dataclasses.asdict(self.llm.scheduler_stats),
            "restarts": self.llm.num_restarts,
            "serving": self.llm.is_healthy,
        }

    def __del__(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.close()

    def _error(
        self, message: str, status: int, param: str | None = None, code: str = "", unavailable: bool = False
    ) -> dict[str, Any]:
        return {
            "replica": self.name,
            "error": message,
            "status": status,
            "param": param,
            "code": code,
            "unavailable": unavailable,
        }


# ---------------------------------------------------------------------- the router


def _ray_router_base() -> type:
    from ray.serve.request_router import RequestRouter

    return RequestRouter


class CacheAwareRequestRouter(_ray_router_base()):  # type: ignore[misc]
    """Ray Serve's ``RequestRouter`` with ``routing``'s policy (``request_router_kwargs``:
    ``routing``, ``block_size``, ``balance``). One lives in each process that holds a handle to
    the replicas (the ingress); routers share no state, and rendezvous hashing sends a new
    prefix to the same replica from any of them."""

    def initialize_state(
        self, routing: str = "cache_aware", block_size: int = 16, balance: float = DEFAULT_BALANCE
    ) -> None:
        self.policy = (
            CacheAwareRouter(block_size=block_size, balance=balance)
            if routing == "cache_aware"
            else make_router(routing, block_size)
        )
        self.in_flight: Counter[str] = Counter()  # this router's requests on each replica
        self._placed: dict[str, str] = {}  # request -> the replica it was counted on, until it completes
        self._lock = threading.Lock()
        routing_module.BOARD.routers.append(self)

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        payload = _payload(pending_request)
        if payload is None or not candidate_replicas:
            return [candidate_replicas]
        now = time.monotonic()
        unavailable = routing_module.BOARD.unavailable
        usable = [r for r in candidate_replicas if unavailable.get(_name(r), 0.0) <= now] or candidate_replicas
        by_name = {_name(r): r for r in usable}
        loads = {name: self._load(name, r) for name, r in by_name.items()}
        with self._lock:
            chosen = self.policy.choose(list(by_name), loads, payload["prompt_token_ids"], payload["grammar_key"])
            # counted where it was chosen at once: Ray Serve reports a request routed only after the
            # replica accepted it (a round trip), and the requests chosen meanwhile must see it
            self._place(_request_id(pending_request), chosen, payload)
        rest = sorted((r for name, r in by_name.items() if name != chosen), key=lambda r: loads[_name(r)])
        return [[by_name[chosen]], rest] if rest else [[by_name[chosen]]]

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        """Where Ray Serve sent it after all (another replica where the chosen one refused it)."""
        payload = _payload(pending_request)
        if payload is None:
            return
        with self._lock:
            request = _request_id(pending_request)
            if self._placed.get(request) != replica_id.to_full_id_str():
                self._place(request, replica_id.to_full_id_str(), payload)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        with self._lock:
            name = self._placed.pop(internal_request_id, None)
            if name is not None and self.in_flight[name] > 0:
                self.in_flight[name] -= 1

    def _place(self, request: str, name: str, payload: dict[str, Any]) -> None:
        """Count ``request`` on replica ``name`` (off the one it was counted on before, if any)."""
        before = self._placed.get(request)
        if before is not None and self.in_flight[before] > 0:
            self.in_flight[before] -= 1
        self._placed[request] = name
        self.in_flight[name] += 1
        self.policy.routed(name, payload["prompt_token_ids"], payload["grammar_key"])

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.to_full_id_str())

    def update_replicas(self, replicas: list[Any]) -> None:
        before = {r.to_full_id_str() for r in self._replica_id_set}
        super().update_replicas(replicas)
        for name in before - {r.to_full_id_str() for r in self._replica_id_set}:
            self._forget(name)

    def replica_figures(self) -> list[dict[str, Any]]:
        """Each replica's last report (``EngineReplica.record_routing_stats``)."""
        return [dict(r.routing_stats) for r in self.curr_replicas.values() if r.routing_stats]

    def _load(self, name: str, replica: Any) -> float:
        """This router's requests in flight on the replica: exact, where Ray Serve's cached queue
        lengths lag (a request that finished may still count there, and spill the next one)."""
        return float(self.in_flight[name])

    def _forget(self, name: str) -> None:
        with self._lock:
            self.policy.forget(name)
            self.in_flight.pop(name, None)


def _name(replica: Any) -> str:
    return str(replica.replica_id.to_full_id_str())


def _request_id(pending_request: Any) -> str:
    metadata = getattr(pending_request, "metadata", None)
    return str(getattr(metadata, "internal_request_id", None) or id(pending_request))


def _payload(pending_request: Any) -> dict[str, Any] | None:
    args = getattr(pending_request, "args", None)
    if args and isinstance(args[0], dict) and "prompt_token_ids" in args[0]:
        return args[0]
    return None


# ---------------------------------------------------------------------- the ingress


class ReplicaClient:
    """The server's engine (``EngineClient``) in the ingress: requests checked here as an ``LLM``
    checks them, then streamed from the replicas."""

    def __init__(self, handle: Any, config: EngineConfig, chat_template: str | None) -> None:
        from guidespec.model_files import load_tokenizer

        self.config = config
        self.tokenizer = load_tokenizer(config.model_dir)
        self.prompts = PromptEncoder(self.tokenizer, config.vocab_size, config.max_model_len, chat_template)
        self.on_gave_up: Callable[[str], None] | None = None
        self._handle = handle.options(stream=True)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        return self.prompts.encode(prompt)

    def open_stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, stream: bool = True
    ) -> RequestHandle:
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("sampling_params must be a SamplingParams", "sampling_params")
        params.validate(self.config.vocab_size)
        ids = self.encode_prompt(prompt)
        validate_request(ids, params, self.config.vocab_size, self.config.max_model_len)
        payload = {"prompt_token_ids": ids, "params": params, "stream": stream, "grammar_key": grammar_key_of(params)}
        output = GenerationOutput(f"req-{uuid.uuid4().hex[:16]}", ids, arrival_time=time.time())
        return RequestHandle(output, self._follow(payload, output))

    async def _follow(self, payload: dict[str, Any], out: GenerationOutput) -> AsyncIterator[StreamDelta]:
        """The request's deltas from a replica; one that refuses it as unavailable before any
        token (its engine restarting) hands it to another, a few times at most."""
        import ray.exceptions

        for attempt in range(3):
            response = self._handle.generate.remote(payload)
            try:
                async for item in response:
                    out.replica = item["replica"]
                    if "error" in item:
                        if item["unavailable"]:
                            routing_module.BOARD.unavailable[item["replica"]] = time.monotonic() + UNAVAILABLE_S
                            if attempt < 2:
                                break
                        raise _engine_error(item)
                    yield self._apply(out, item)
                    if out.finished:
                        return
                else:
                    raise EngineDeadError("the replica ended the request's stream before it finished")
            except ray.exceptions.RayError as e:  # the replica's actor died, or its node was lost
                if out.replica:
                    routing_module.BOARD.unavailable[out.replica] = time.monotonic() + UNAVAILABLE_S
                logger.warning("request %s: its replica failed: %s", out.request_id, e)
                raise EngineDeadError(f"the replica serving this request died ({type(e).__name__})") from None
            finally:
                if not out.finished:
                    response.cancel()  # (the replica aborts the request)
        raise EngineRestartingError("no replica can take the request now: their engines are restarting")

    def _apply(self, out: GenerationOutput, item: dict[str, Any]) -> StreamDelta:
        out.text += item["text"]
        out.token_ids.extend(item["token_ids"])
        out.first_token_time = out.first_token_time or item["first_token_time"]
        out.grammar_backend = out.grammar_backend or item["grammar_backend"]
        out.grammar_refusal = out.grammar_refusal or item["grammar_refusal"]
        if item.get("stats") is not None:
            out.stats = DecodeStats(**item["stats"])
        if item["finished"]:
            out.finished, out.finish_reason, out.finish_time = True, item["finish_reason"], time.time()
        finished, reason = item["finished"], item["finish_reason"]
        return StreamDelta(out.request_id, item["text"], list(item["token_ids"]), finished, reason)

    def check_alive(self) -> None:
        figures = self._figures()
        if figures and not any(f.get("serving") for f in figures):
            raise EngineRestartingError("every replica's engine is restarting")

    @property
    def gave_up(self) -> bool:
        return False  # (Ray Serve replaces a replica whose engine gave up)

    @property
    def num_restarts(self) -> int:
        return sum(int(f.get("restarts", 0)) for f in self._figures())

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The replicas' queues and counters, added up (as they last reported them)."""
        return SchedulerStats.total([f["stats"] for f in self._figures() if "stats" in f])

    def _figures(self) -> list[dict[str, Any]]:
        """The replicas' last reports, one each (every router of this process sees them all)."""
        routers = routing_module.BOARD.routers
        return list({f["replica"]: f for router in routers for f in router.replica_figures()}.values())


def _engine_error(item: dict[str, Any]) -> Exception:
    if item["status"] == ENGINE_UNAVAILABLE:
        return EngineDeadError(item["error"])
    return RequestError(item["error"], item["status"], item.get("code") or "")


class Ingress:
    """The HTTP side: ``guidespec serve``'s app over a ``ReplicaClient``."""

    def __init__(
        self, engines: Any, config: EngineConfig, model_name: str, api_key: str | None, chat_template: str | None
    ) -> None:
        self.client = ReplicaClient(engines, config, chat_template)
        self.model_name, self.api_key = model_name, api_key

    def __serve_build_asgi_app__(self) -> Any:
        from guidespec.entrypoints.server.app import create_app

        return create_app(self.client, self.model_name, self.api_key)


# ---------------------------------------------------------------------- the application


def llm_arguments(**overrides: Any) -> dict[str, Any]:
    """``LLM``'s keyword arguments: its defaults, with ``overrides``."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(LLM.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    unknown = set(overrides) - set(defaults)
    if unknown:
        raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
    return {**defaults, **overrides}


def build_app(
    model: str | None = None,
    *,
    num_replicas: int = 2,
    routing: str = "cache_aware",
    routing_balance: float = DEFAULT_BALANCE,
    served_model_name: str | None = None,
    api_key: str | None = None,
    cpus_per_rank: float = 1.0,
    **llm_kwargs: Any,
) -> Any:
    """The Ray Serve application: ``num_replicas`` engines of ``LLM(model, **llm_kwargs)`` and the
    ingress. Checks the arguments and the model here, before anything is deployed."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from guidespec.launch.engine_config import create_engine_config

    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
    if routing not in ROUTING_POLICIES:
        raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {routing!r}")
    routing_balance = check_balance(routing_balance)
    kwargs = llm_arguments(**llm_kwargs)
    kwargs.pop("restart_on_failure")
    kwargs["distributed_executor"] = "mp"  # a replica's ranks: processes beside it, in its bundle
    kwargs["show_progress"] = False
    if kwargs["grammar_cache_dir"] is None:  # one folder per node, shared by its replicas
        kwargs["grammar_cache_dir"] = _grammar_folder()
    chat_template = load_chat_template(kwargs.pop("chat_template"))
    config_args = {k: v for k, v in kwargs.items() if k not in ("restart_on_failure",)}
    config, _ = create_engine_config(model, warm_up=False, **config_args)
    kwargs["chat_template"] = chat_template
    tp = config.tensor_parallel_size
    gpus = tp if config.device == "cuda" else 0
    # the replica actor itself holds the bundle's CPUs for its ranks (processes it starts)
    bundle = {"CPU": float(cpus_per_rank * tp), **({"GPU": float(gpus)} if gpus else {})}
    engine = serve.deployment(
        EngineReplica,
        name=ENGINE_DEPLOYMENT,
        num_replicas=num_replicas,
        max_ongoing_requests=max(64, 4 * config.max_batch_size),
        ray_actor_options={"num_cpus": bundle["CPU"], "num_gpus": float(gpus)},
        placement_group_bundles=[bundle],
        placement_group_strategy="STRICT_PACK",
        health_check_period_s=2,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=30,
        request_router_config=RequestRouterConfig(
            request_router_class=CacheAwareRequestRouter,
            request_router_kwargs={"routing": routing, "block_size": config.kv_block_size, "balance": routing_balance},
            request_routing_stats_period_s=STATS_PERIOD_S,
            request_routing_stats_timeout_s=10 * STATS_PERIOD_S,
        ),
    ).bind(model, kwargs)
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=100_000,
        ray_actor_options={"num_cpus": 0},
    )
    name = served_model_name or (model and os.path.basename(os.path.normpath(model))) or "SmolLM2-135M-Instruct"
    return ingress.bind(engine, config, name, api_key, chat_template)


def _grammar_folder() -> str:
    """A new folder's path under the temporary directory (each node makes its own)."""
    return os.path.join(tempfile.gettempdir(), f"gs-grammars-{uuid.uuid4().hex[:12]}")


def app_builder(args: dict[str, str]) -> Any:
    """``serve run guidespec.entrypoints.ray_serve:app_builder model=DIR num_replicas=2 ...``: the
    application from ``key=value`` arguments (``build_app``'s and ``LLM``'s, typed by their
    defaults: ``tensor_parallel_size=2``, ``routing=round_robin``, ``grammar_cache_dir=/shared/dir``)."""
    typed: dict[str, Any] = {}
    defaults = llm_arguments()
    defaults.update(
        num_replicas=2,
        routing="cache_aware",
        routing_balance=DEFAULT_BALANCE,
        served_model_name=None,
        api_key=None,
        cpus_per_rank=1.0,
    )
    for key, value in args.items():
        if key == "model":
            continue
        if key not in defaults:
            raise ValueError(f"unknown argument {key!r}")
        default = defaults[key]
        typed[key] = _typed(value, default)
    return build_app(args.get("model"), **typed)


def _typed(value: str, default: Any) -> Any:
    """A ``key=value`` argument's value as its default's type; where the default is None (the
    argument is optional: ``max_model_len``, ``speculative``), a number where it reads as one."""
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        return float(value)
    if default is None:
        if value.lower() in ("none", "null"):
            return None
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
    return value


def serve_on_ray(args: argparse.Namespace, name: str) -> int:
    """``guidespec serve --data-parallel-size N --distributed-executor ray``: the application on
    the cluster (``--ray-address``, else the current or a new local one), its HTTP proxy on
    ``--host``:``--port``, until SIGTERM / Ctrl-C; then every replica drains and stops."""
    import ray
    from ray import serve

    from guidespec.entrypoints.args import engine_from_args
    from guidespec.launch.ray_executor import join_cluster

    kwargs = engine_from_args(args)
    kwargs.pop("distributed_executor")
    address = kwargs.pop("ray_address")
    own_folder = kwargs["grammar_cache_dir"] is None  # (this node's copy is removed at the end)
    if own_folder:
        kwargs["grammar_cache_dir"] = _grammar_folder()
    app = build_app(
        args.model,
        num_replicas=args.data_parallel_size,
        routing=args.routing,
        routing_balance=args.routing_balance,
        served_model_name=name,
        api_key=args.api_key,
        **kwargs,
    )
    undo_auth = join_cluster(address)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name="guidespec", route_prefix="/")
        print(
            f"guidespec: serving {name} on http://{args.host}:{args.port}/v1 "
            f"({args.data_parallel_size} replicas on Ray Serve)",
            flush=True,
        )
        stop.wait()
    finally:
        # deleting the app drains it (requests in flight finish, within each deployment's graceful
        # shutdown timeout, then each replica's engine stops); serve.shutdown alone stops the HTTP
        # proxy at once and drops them (measured: a request in flight got no response)
        try:
            serve.delete("guidespec")
        finally:
            serve.shutdown()
        ray.shutdown()
        undo_auth()
        if own_folder:
            shutil.rmtree(kwargs["grammar_cache_dir"], ignore_errors=True)
    return 0
