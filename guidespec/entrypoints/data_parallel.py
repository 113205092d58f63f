"""Data-parallel replicas on this machine, without Ray: ``EngineGroup`` starts N engines (each
an ``LLM``: a scheduler and its tensor-parallel ranks) and serves as one client, as the server's
engine (``guidespec serve --data-parallel-size N``). Each request goes to the engine a router
picks (``routing``: the one holding its prompt's prefix and its grammar, bounded by load); the
engines share one folder of compiled grammars (``grammar_cache_dir``, a temporary one unless
given), so a schema is compiled once among them.

An engine that dies fails its own requests in flight (503, as one engine does), is taken out of
the routing at once and forgotten by the router (its caches died with it); with
``restart_on_failure`` it comes back and takes requests again. The others never notice. On a
Ray cluster the same replicas run as a Ray Serve application: ``ray_serve``.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from typing import Any, AsyncIterator, Callable, Sequence

from guidespec.launch.routing import DEFAULT_BALANCE, ROUTING_POLICIES, check_balance, grammar_key_of, make_router
from guidespec.llm import LLM, EngineDeadError, GenerationOutput, RequestHandle, StreamDelta
from guidespec.prompts import Prompt, as_prompt_list
from guidespec.protocol import SamplingParams, SchedulerStats


class EngineGroup:
    """``size`` engines of ``LLM(model, **llm_kwargs)`` behind one client. It offers what the
    server uses of an ``LLM`` (``encode_prompt``, ``open_stream``, ``check_alive``, the figures)
    and ``generate``; ``routing``: ``cache_aware`` (default) or ``round_robin``; ``routing_balance``:
    the cache-aware router's load bound (a multiple of the mean requests in flight)."""

    def __init__(
        self,
        size: int,
        model: str | None = None,
        *,
        routing: str = "cache_aware",
        routing_balance: float = DEFAULT_BALANCE,
        **llm_kwargs: Any,
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"data_parallel_size must be a positive int, got {size!r}")
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {routing!r}")
        check_balance(routing_balance)
        self._own_dir: str | None = None
        if llm_kwargs.get("grammar_cache_dir") is None:
            self._own_dir = tempfile.mkdtemp(prefix="guidespec-grammars-")
            llm_kwargs["grammar_cache_dir"] = self._own_dir
        self.engines: list[LLM] = []
        self._on_gave_up: Callable[[str], None] | None = None
        try:
            for _ in range(size):
                self.engines.append(LLM(model, **llm_kwargs))
        except BaseException:
            self.close()
            raise
        self.names = [f"replica-{i}" for i in range(size)]
        first = self.engines[0]
        self.config, self.tokenizer, self.prompts = first.config, first.tokenizer, first.prompts
        self.router = make_router(routing, self.config.kv_block_size, routing_balance)
        self.in_flight = [0] * size  # requests each engine serves now
        self.num_routed = [0] * size  # requests sent to each since start
        self._serving = [True] * size  # healthy at the last look (a change to False: the router forgets it)
        self._lock = threading.Lock()
        for engine in self.engines:
            engine.on_gave_up = self._engine_gave_up

    # ------------------------------------------------------------------ what the server uses

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        return self.engines[0].encode_prompt(prompt)

    def open_stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, stream: bool = True
    ) -> RequestHandle:
        """As ``LLM.open_stream``, on the engine the router picks; ``handle.output.replica``
        names it."""
        params = sampling_params or SamplingParams()
        ids, key = self.encode_prompt(prompt), grammar_key_of(params)
        with self._lock:
            i = self._pick(ids, key)
            handle = self.engines[i].open_stream({"prompt_token_ids": ids}, params, stream)
            self._sent(i, ids, key)
        handle.output.replica = self.names[i]
        return RequestHandle(handle.output, self._follow(i, handle.deltas()))

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None
    ) -> list[GenerationOutput]:
        """As ``LLM.generate``: the prompts spread over the engines, the outputs in order."""
        params = sampling_params or SamplingParams()
        submitted: list[tuple[int, Any]] = []
        try:
            for prompt in as_prompt_list(prompts):
                ids, key = self.encode_prompt(prompt), grammar_key_of(params)
                with self._lock:
                    i = self._pick(ids, key)
                    submitted.append((i, self.engines[i]._submit({"prompt_token_ids": ids}, params, stream=False)))
                    self._sent(i, ids, key)
                submitted[-1][1].output.replica = self.names[i]
            for i, request in submitted:
                self.engines[i]._drain(request)
        except BaseException:
            for i, request in submitted:
                if not request.output.finished:
                    self.engines[i].abort(request.output.request_id)
            raise
        finally:
            with self._lock:
                for i, _ in submitted:
                    self.in_flight[i] -= 1
        return [request.output for _, request in submitted]

    def check_alive(self) -> None:
        """Serving while any engine serves; else the first engine's error (dead or restarting)."""
        if any(engine.is_healthy for engine in self.engines):
            return
        self.engines[0].check_alive()
        raise EngineDeadError("no engine of the group is serving")

    @property
    def is_healthy(self) -> bool:
        return any(engine.is_healthy for engine in self.engines)

    @property
    def gave_up(self) -> bool:
        """Every engine died for good."""
        return all(engine.gave_up for engine in self.engines)

    @property
    def on_gave_up(self) -> Callable[[str], None] | None:
        return self._on_gave_up

    @on_gave_up.setter
    def on_gave_up(self, callback: Callable[[str], None] | None) -> None:
        self._on_gave_up = callback

    @property
    def num_restarts(self) -> int:
        return sum(engine.num_restarts for engine in self.engines)

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The engines' queues and counters, added up."""
        return SchedulerStats.total([engine.scheduler_stats for engine in self.engines])

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)

    def __enter__(self) -> EngineGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _pick(self, ids: list[int], grammar_key: str) -> int:
        """The engine for a request (under the lock); raises when none is serving."""
        live = []
        for i, engine in enumerate(self.engines):
            healthy = engine.is_healthy
            if self._serving[i] and not healthy:
                self.router.forget(self.names[i])  # its KV cache and grammars are gone
            self._serving[i] = healthy
            if healthy:
                live.append(self.names[i])
        if not live:
            self.check_alive()
        loads = {self.names[i]: float(self.in_flight[i]) for i in range(len(self.engines))}
        return self.names.index(self.router.choose(live, loads, ids, grammar_key))

    def _sent(self, i: int, ids: list[int], grammar_key: str) -> None:
        self.router.routed(self.names[i], ids, grammar_key)
        self.in_flight[i] += 1
        self.num_routed[i] += 1

    async def _follow(self, i: int, deltas: AsyncIterator[StreamDelta]) -> AsyncIterator[StreamDelta]:
        try:
            async for delta in deltas:
                yield delta
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]
            with self._lock:
                self.in_flight[i] -= 1

    def _engine_gave_up(self, reason: str) -> None:
        if self.gave_up and self._on_gave_up is not None:
            self._on_gave_up(reason)
