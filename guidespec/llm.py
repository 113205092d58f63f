"""The Python client: ``LLM`` starts an engine (scheduler + workers) and talks to it over ZeroMQ.

The client tokenizes and validates: anything the engine cannot serve (an empty or over-long
prompt, bad sampling parameters, a missing model, an unsupported architecture) raises here,
before it reaches the scheduler. A receiver thread routes the scheduler's output deltas to
per-request streams, which back the blocking, streaming and asyncio forms alike. Used as a
context manager (or at interpreter exit) it stops every process and removes every shared
resource, also after Ctrl-C or an exception.

When an engine process dies, every request in flight ends at once with ``EngineDeadError``
(the server's 503). With ``restart_on_failure`` (the server's default) a fresh engine then
starts in the background, with new processes, shared memory and sockets, while new requests
get ``EngineRestartingError``; deaths in a crash loop (``envs.crash_loop()``: 3 within 60 s)
stop the restarts and leave the LLM dead, for a supervisor to act.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
import uuid
import weakref
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, Sequence, Union

import numpy as np
import zmq

from guidespec import envs
from guidespec.config import DTYPES, JUMP_FORWARD_MODES, EngineConfig, ModelConfig, SpeculativeConfig
from guidespec.ipc.zmq_channel import Channel
from guidespec.launch import zygote
from guidespec.launch.launcher import EngineProcesses
from guidespec.protocol import (
    BACKEND_CHOICES,
    ENGINE_UNAVAILABLE,
    INTERNAL_ERROR,
    AbortRequest,
    DecodeStats,
    EngineDead,
    EngineReady,
    GenerateRequest,
    InvalidRequest,
    RequestOutput,
    RequestOutputs,
    SamplingParams,
    SchedulerStats,
    Shutdown,
    validate_prompt,
    validate_request,
)
from guidespec import model_files

logger = logging.getLogger(__name__)
Message = dict[str, str]
Prompt = Union[str, list[Message], dict[str, Any]]
_RESTART_GRACE_S = 0.5  # a dead engine's other processes get this long to exit before SIGKILL


class EngineDeadError(RuntimeError):
    """The engine's processes are gone: a request in flight when it died, or a new one."""


class EngineRestartingError(EngineDeadError):
    """The engine died and a fresh one is starting: retry in a few seconds."""


class RequestError(RuntimeError):
    """The engine refused (``status`` 400) or failed (500) one request; the others go on.
    ``code``: the failure's kind where it has one of its own: ``"grammar_failed"`` (500), its
    grammar stopped before the output was complete (a backend's limit met mid-way), so there is
    no valid answer to give."""

    def __init__(self, message: str, status: int = 400, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    arrival_time: float = 0.0
    first_token_time: float = 0.0
    finish_time: float = 0.0
    stats: DecodeStats = field(default_factory=DecodeStats)  # steps, drafts and acceptance
    grammar_backend: str = ""  # guided: the backend that enforced the grammar
    grammar_refusal: str = ""  # guided, backend "auto": why the backend tried first refused, if it did

    @property
    def time_to_first_token_s(self) -> float:
        return max(0.0, self.first_token_time - self.arrival_time) if self.first_token_time else 0.0

    @property
    def latency_s(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float:
        """Output tokens after the first, per second after the first token."""
        span = self.finish_time - self.first_token_time
        return (len(self.token_ids) - 1) / span if len(self.token_ids) > 1 and span > 0 else 0.0


@dataclass
class StreamDelta:
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None


@dataclass
class RequestHandle:
    """A request in flight on an event loop (``LLM.open_stream``)."""

    output: GenerationOutput
    _deltas: AsyncIterator[StreamDelta]

    def deltas(self) -> AsyncIterator[StreamDelta]:
        return self._deltas


class _RequestStream:
    """Where one request's deltas land; read by a thread or an asyncio task."""

    def __init__(self, output: GenerationOutput, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.output = output
        self.loop = loop
        self.queue: queue.Queue[RequestOutput] | asyncio.Queue[RequestOutput] = (
            asyncio.Queue() if loop else queue.Queue()
        )

    def put(self, delta: RequestOutput) -> None:
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)
            except RuntimeError:  # its event loop is closed: nobody is waiting
                pass
        else:
            self.queue.put(delta)

    def apply(self, delta: RequestOutput) -> StreamDelta:
        out = self.output
        if delta.error and delta.finish_reason == "error":
            if delta.error_status == ENGINE_UNAVAILABLE:
                raise EngineDeadError(delta.error)
            raise RequestError(
                f"request {delta.request_id}: {delta.error}", delta.error_status or INTERNAL_ERROR, delta.error_code
            )
        out.text += delta.new_text
        out.token_ids.extend(delta.new_token_ids)
        out.first_token_time = out.first_token_time or delta.first_token_time
        out.grammar_backend = out.grammar_backend or delta.grammar_backend
        out.grammar_refusal = out.grammar_refusal or delta.grammar_refusal
        if delta.stats is not None:
            out.stats = delta.stats
        if delta.finished:
            out.finished, out.finish_reason, out.finish_time = True, delta.finish_reason, time.time()
        return StreamDelta(
            out.request_id, delta.new_text, list(delta.new_token_ids), delta.finished, delta.finish_reason
        )


class LLM:
    """An engine on this machine. ``LLM()`` serves the embedded SmolLM2-135M-Instruct."""

    def __init__(
        self,
        model: str | None = None,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        max_batch_size: int = 16,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 512,
        show_progress: bool = True,
        remote_ranks: Sequence[int] = (),
        grammar_backend: str = "auto",
        grammar_compile_timeout_s: float = 30.0,
        jump_forward: bool | str = True,
        speculative: SpeculativeConfig | dict[str, Any] | str | None = None,
        distributed_executor: str = "mp",
        ray_address: str | None = None,
        enable_prefix_caching: bool = True,
        restart_on_failure: bool = False,
        device: str = "auto",
        enforce_eager: bool = False,
        gpu_memory_utilization: float = 0.9,
        ray_placement: str = "pack",
        graph_grammar: bool | None = None,
        grammar_fill_threads: int = 1,
    ) -> None:
        if grammar_backend not in BACKEND_CHOICES:
            raise ValueError(f"grammar_backend must be one of {', '.join(BACKEND_CHOICES)}, got {grammar_backend!r}")
        if grammar_compile_timeout_s <= 0:
            raise ValueError("grammar_compile_timeout_s must be > 0")
        if distributed_executor not in ("mp", "ray"):
            raise ValueError(f"distributed_executor must be 'mp' or 'ray', got {distributed_executor!r}")
        if distributed_executor == "ray" and remote_ranks:
            raise ValueError("remote_ranks and distributed_executor='ray' do not mix: under Ray every rank is remote")
        if not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        if (
            isinstance(grammar_fill_threads, bool)
            or not isinstance(grammar_fill_threads, int)
            or not 1 <= grammar_fill_threads <= 64
        ):
            raise ValueError(f"grammar_fill_threads must be an int in [1, 64], got {grammar_fill_threads!r}")
        if ray_placement not in ("pack", "spread"):
            raise ValueError(f"ray_placement must be 'pack' or 'spread', got {ray_placement!r}")
        from guidespec.worker.device import resolve_device, resolve_dtype

        # Ray places its ranks itself: only a local launch needs the GPUs here
        local = 0 if distributed_executor == "ray" else tensor_parallel_size
        resolved_device = resolve_device(device, local, share_gpus=envs.tp_backend() == "gloo")
        zygote.warm_up(resolved_device)
        # a GGUF model's own quantized blocks (where the model is a GGUF file's conversion), with fp32
        # arithmetic around them: what "auto" means on the CPU; "float32" dequantizes them
        gguf_blocks = dtype == "gguf" or (dtype == "auto" and resolved_device == "cpu")
        if dtype == "gguf" and resolved_device != "cpu":
            raise ValueError("dtype 'gguf' (the GGUF file's own quantized blocks) runs on CPU workers only")
        config, self.tokenizer = _create_engine_config(
            model,
            tensor_parallel_size,
            "float32" if gguf_blocks else resolve_dtype(dtype, resolved_device),
            max_batch_size,
            max_model_len,
            max_num_batched_tokens,
            show_progress,
            tuple(remote_ranks),
        )
        spec_config = _speculative_config(speculative)
        self.config = dataclasses.replace(
            config,
            quantized_weights=gguf_blocks,
            grammar_backend=grammar_backend,
            jump_forward=_jump_forward_mode(jump_forward),
            grammar_compile_timeout_s=grammar_compile_timeout_s,
            speculative=spec_config,
            distributed_executor=distributed_executor,
            ray_address=ray_address,
            enable_prefix_caching=enable_prefix_caching,
            device=resolved_device,
            enforce_eager=bool(enforce_eager),
            graph_grammar=None if graph_grammar is None else bool(graph_grammar),
            grammar_fill_threads=grammar_fill_threads,
            gpu_memory_utilization=float(gpu_memory_utilization),
            ray_placement=ray_placement,
        )
        self.restart_on_failure = restart_on_failure
        self.num_restarts = 0  # fresh engines started after a death
        self.on_gave_up: Callable[[str], None] | None = None  # called (once) when the engine died for good
        self.scheduler_stats = SchedulerStats(0, 0, 0, max_batch_size)  # the queue, as the scheduler last said
        self._streams: dict[str, _RequestStream] = {}
        self._state_lock = threading.Lock()  # streams, engine, and the states below change together
        self._dead_reason: str | None = None  # set for good: closed, or a crash loop
        self._restarting: str | None = None  # why the engine is restarting
        self._deaths: collections.deque[float] = collections.deque()
        # restarts run on one thread that lives as long as the LLM: the engine processes die with
        # the thread that started them (PR_SET_PDEATHSIG), so it must outlive them
        self._restarter: threading.Thread | None = None
        self._restart_queue: queue.Queue[_Engine | None] = queue.Queue()
        self._closed = False
        self._ids = itertools.count()
        self._ctx = zmq.Context()
        self._current: list[_Engine] = []  # the live engine (a list, so the finalizer sees restarts)
        self._finalizer = weakref.finalize(self, _close_engines, self._current)
        atexit.register(self._finalizer)
        try:
            self._engine = self._start_engine()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ public API

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None, use_tqdm: bool = False
    ) -> list[GenerationOutput]:
        """Generate for one or several prompts (strings, chat message lists, or {"prompt_token_ids": [...]})."""
        params = sampling_params or SamplingParams()
        streams = [self._submit(p, params, stream=False) for p in _as_prompt_list(prompts)]
        try:
            bar = _progress(len(streams)) if use_tqdm else None
            for stream in streams:
                self._drain(stream)
                if bar is not None:
                    bar.update(1)
        except BaseException:
            for stream in streams:
                if not stream.output.finished:
                    self.abort(stream.output.request_id)
            raise
        return [s.output for s in streams]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield text deltas for one prompt as tokens arrive; the last one has ``finished=True``."""
        stream = self._submit(prompt, sampling_params or SamplingParams())
        try:
            while True:
                delta = stream.apply(self._get(stream))
                yield delta
                if delta.finished:
                    return
        finally:
            if not stream.output.finished:
                self.abort(stream.output.request_id)

    async def agenerate(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> GenerationOutput:
        stream = self._submit(
            prompt, sampling_params or SamplingParams(), loop=asyncio.get_running_loop(), stream=False
        )
        async for _ in self._follow(stream):
            pass
        return stream.output

    async def astream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> AsyncIterator[StreamDelta]:
        stream = self._submit(prompt, sampling_params or SamplingParams(), loop=asyncio.get_running_loop())
        async for delta in self._follow(stream):
            yield delta

    def open_stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, stream: bool = True
    ) -> RequestHandle:
        """Submit a request from a running event loop (the server's way in): ``handle.output``
        holds its output so far (prompt ids, text, figures), ``handle.deltas()`` yields its
        deltas. Bad input raises here; leaving the iteration early aborts the request. With
        ``stream=False`` the one delta is the finished output (until then the engine may start
        the request again on another grammar backend: ``RequestError``)."""
        request = self._submit(
            prompt, sampling_params or SamplingParams(), loop=asyncio.get_running_loop(), stream=stream
        )
        return RequestHandle(request.output, self._follow(request))

    def abort(self, request_id: str) -> None:
        if self._dead_reason is None and self._restarting is None and not self._closed:
            self._engine.send(AbortRequest(request_id))

    @property
    def is_healthy(self) -> bool:
        """Serving now: not closed, not dead, not restarting."""
        return not self._closed and self._dead_reason is None and self._restarting is None

    @property
    def gave_up(self) -> bool:
        """The engine died and will not be restarted (restarts off, or a crash loop)."""
        return not self._closed and self._dead_reason is not None

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids for a prompt: chat messages go through the tokenizer's chat template."""
        if isinstance(prompt, dict):
            ids = prompt.get("prompt_token_ids")
            if not isinstance(ids, (list, tuple, np.ndarray)):
                raise InvalidRequest("a dict prompt must have 'prompt_token_ids': a list of token ids", "prompt")
            validate_prompt(list(ids), self.config.vocab_size, self.config.max_model_len)
            return [int(t) for t in ids]
        if isinstance(prompt, list):
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt is a string, a list of chat messages or a dict, not {type(prompt).__name__}")
        return list(self.tokenizer.encode(prompt))

    def close(self) -> None:
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        restarter = self._restarter
        if restarter is not None:  # it closes the engine it was starting when it sees _closed
            self._restart_queue.put(None)
            restarter.join(timeout=envs.worker_start_timeout_s())
        self._finalizer()
        atexit.unregister(self._finalizer)
        self._ctx.term()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop | None = None,
        stream: bool = True,
    ) -> _RequestStream:
        """Validate (``validate_request``: the one check of the API and the server), then send."""
        self._check_alive()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("sampling_params must be a SamplingParams", "sampling_params")
        params.validate(self.config.vocab_size)
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequest("the prompt is empty", "prompt")
        ids = self.encode_prompt(prompt)
        validate_request(ids, params, self.config.vocab_size, self.config.max_model_len)
        request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        now = time.time()
        request = _RequestStream(GenerationOutput(request_id, ids, arrival_time=now), loop)
        with self._state_lock:  # a death after this fails the stream; one before it refuses it
            self._check_alive()
            self._streams[request_id] = request
            engine = self._engine
        engine.send(GenerateRequest(request_id, np.array(ids, dtype=np.int32), params, now, stream))
        return request

    async def _follow(self, stream: _RequestStream) -> AsyncIterator[StreamDelta]:
        """A request's deltas on the event loop; leaving early aborts the request."""
        try:
            while not stream.output.finished:
                yield stream.apply(await stream.queue.get())  # type: ignore[misc]
        finally:
            if not stream.output.finished:
                self.abort(stream.output.request_id)

    def _drain(self, stream: _RequestStream) -> None:
        while not stream.output.finished:
            stream.apply(self._get(stream))

    def _get(self, stream: _RequestStream) -> RequestOutput:
        while True:
            try:
                return stream.queue.get(timeout=0.1)  # type: ignore[call-arg, return-value]
            except queue.Empty:
                with self._state_lock:  # a death queues this stream's error before it marks the engine down
                    try:
                        self._check_alive()
                    except EngineDeadError:
                        try:
                            return stream.queue.get_nowait()  # type: ignore[return-value]
                        except queue.Empty:
                            raise

    def _route(self, message: object) -> None:
        """The receiver thread's handling of one scheduler message (``_Engine._receive_loop``)."""
        if isinstance(message, RequestOutputs):
            for output in message.outputs:
                if isinstance(output, RequestOutput):
                    self._route(output)
        elif isinstance(message, RequestOutput):
            stream = self._streams.get(message.request_id)
            if stream is not None:
                if message.finished:
                    self._streams.pop(message.request_id, None)
                stream.put(message)
        elif isinstance(message, SchedulerStats):
            self.scheduler_stats = message

    # ------------------------------------------------------------------ failure and restart

    def _start_engine(self) -> _Engine:
        engine = _Engine(self.config, self._ctx, self._on_engine_death, self._route)
        self._current[:] = [engine]
        try:
            engine.start()
        except BaseException:
            engine.close(_RESTART_GRACE_S)
            self._current.clear()
            raise
        return engine

    def _on_engine_death(self, engine: _Engine, reason: str) -> None:
        """An engine process died (the launcher's monitor) or the scheduler said so: fail every
        request in flight now, then restart or give up."""
        with self._state_lock:
            # an engine still starting (the first, or a restart) is not this: its start fails instead
            if engine is not getattr(self, "_engine", None) or self._closed or self._dead_reason or self._restarting:
                return
            streams = list(self._streams.values())
            self._streams.clear()
            logger.error("the engine died: %s", reason)
            gave_up = self._record_death(reason)
            message = f"the engine died ({reason}); " + (
                "it is restarting: retry shortly" if not gave_up else "it will not be restarted"
            )
            # under the lock: a stream that then sees the engine down finds its own error queued
            for stream in streams:
                stream.put(
                    RequestOutput(
                        stream.output.request_id, [], "", True, "error", message, error_status=ENGINE_UNAVAILABLE
                    )
                )
            if not gave_up:
                self._restarting = reason
                if self._restarter is None:
                    self._restarter = threading.Thread(target=self._restart_loop, daemon=True, name="guidespec-restart")
                    self._restarter.start()
        if gave_up:
            engine.close(_RESTART_GRACE_S)
            if self.on_gave_up is not None:
                self.on_gave_up(self._dead_reason or reason)
        else:
            self._restart_queue.put(engine)

    def _record_death(self, reason: str) -> bool:
        """Count a death (under the state lock); True if the LLM now gives up (no restart wanted,
        or a crash loop), with ``_dead_reason`` set."""
        now = time.monotonic()
        max_deaths, window_s = envs.crash_loop()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > window_s:
            self._deaths.popleft()
        if not self.restart_on_failure:
            self._dead_reason = reason
        elif len(self._deaths) >= max_deaths:
            self._dead_reason = (
                f"{reason} (a crash loop: {len(self._deaths)} engine deaths within {window_s:g} s; not restarting)"
            )
        return self._dead_reason is not None

    def _restart_loop(self) -> None:
        while (dead := self._restart_queue.get()) is not None:
            self._restart(dead)
        self._finalizer()  # the LLM closed: the engines this thread started stop before it ends

    def _restart(self, dead: _Engine) -> None:
        """The restart thread: the dead engine's processes and shared resources gone, a fresh one up."""
        dead.close(_RESTART_GRACE_S)
        while not self._closed:
            start = time.monotonic()
            try:
                engine = self._start_engine()
            except Exception as e:
                logger.exception("a fresh engine failed to start")
                with self._state_lock:
                    gave_up = self._record_death(f"the restarted engine failed to start: {e}")
                if gave_up:
                    self._restarting = None
                    if self.on_gave_up is not None:
                        self.on_gave_up(self._dead_reason or str(e))
                    return
                continue
            with self._state_lock:
                if not self._closed:
                    self._engine, self._restarting = engine, None
                    self.num_restarts += 1
                    logger.warning(
                        "a fresh engine is serving (restart %d took %.1f s)",
                        self.num_restarts,
                        time.monotonic() - start,
                    )
                    return
            engine.close()  # closed while starting
            return

    @property
    def _processes(self) -> EngineProcesses:
        """The live engine's processes (tests look at their pids and shared resources)."""
        return self._engine.processes

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("this LLM is closed")
        if self._dead_reason is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead_reason}")
        if self._restarting is not None:
            raise EngineRestartingError(f"the engine is restarting after a failure ({self._restarting}): retry shortly")


class _Engine:
    """One life of the engine: its processes and the client's two sockets to its scheduler, with
    the thread that receives from it. ``LLM`` replaces it with a fresh one after a death."""

    def __init__(
        self,
        config: EngineConfig,
        ctx: zmq.Context,
        on_death: Callable[[_Engine, str], None],
        route: Callable[[object], None],
    ) -> None:
        self.on_death = on_death
        self.route = route
        self.processes = EngineProcesses(config, on_death=lambda reason: on_death(self, reason))
        self.from_scheduler = Channel(ctx, zmq.PULL, self.processes.endpoints.client_out, bind=True)
        self.to_scheduler = Channel(ctx, zmq.PUSH, self.processes.endpoints.client_in, bind=False)
        self.send_lock = threading.Lock()
        self.closed = False
        self.receiver: threading.Thread | None = None

    def start(self) -> None:
        self.processes.start()
        self._wait_ready()
        self.receiver = threading.Thread(target=self._receive_loop, name="guidespec-receiver", daemon=True)
        self.receiver.start()

    def send(self, message: object) -> None:
        with self.send_lock:
            if not self.closed:
                self.to_scheduler.send(message)

    def close(self, grace_s: float = 3.0) -> None:
        """Stop every process (asked, then killed after ``grace_s``) and remove every shared resource."""
        with self.send_lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.to_scheduler.send(Shutdown("client closed"))
            except Exception:
                pass
            self.to_scheduler.close()
        self.processes.shutdown(grace_s)
        if self.receiver is not None and self.receiver is not threading.current_thread():
            self.receiver.join(timeout=2.0)
        self.from_scheduler.close()

    def _receive_loop(self) -> None:
        while not self.closed:
            try:
                message = self.from_scheduler.recv(timeout_s=0.1)
            except zmq.ZMQError:
                return
            if isinstance(message, EngineDead):
                self.on_death(self, message.reason)
            elif message is not None:
                self.route(message)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + envs.worker_start_timeout_s()
        while time.monotonic() < deadline:
            message = self.from_scheduler.recv(timeout_s=0.2)
            if isinstance(message, EngineReady):
                return
            if isinstance(message, EngineDead):
                raise EngineDeadError(f"the engine failed to start: {message.reason}")
            dead = self.processes.first_dead()
            if dead is not None:
                raise EngineDeadError(f"the engine failed to start: {dead}")
        raise EngineDeadError(f"the engine did not start within {envs.worker_start_timeout_s():.0f} s")


def _create_engine_config(
    model: str | None,
    tensor_parallel_size: int,
    dtype: str,
    max_batch_size: int,
    max_model_len: int | None,
    max_num_batched_tokens: int,
    show_progress: bool,
    remote_ranks: tuple[int, ...],
) -> tuple[EngineConfig, Any]:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if tensor_parallel_size < 1 or max_batch_size < 1 or max_num_batched_tokens < 1:
        raise ValueError("tensor_parallel_size, max_batch_size and max_num_batched_tokens must be >= 1")
    model_dir = model_files.resolve_model_dir(model, show_progress)
    hf_data = model_files.config_data(model_dir)
    hf_config = model_files.load_hf_config(model_dir, hf_data)
    model_cfg = ModelConfig.from_hf(hf_config)
    if any(not 0 < r < tensor_parallel_size for r in remote_ranks):
        raise ValueError(f"remote_ranks must be among ranks 1..{tensor_parallel_size - 1}")
    if model_cfg.num_kv_heads < tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} exceeds the model's {model_cfg.num_kv_heads} key/value heads"
        )
    limit = model_cfg.max_position_embeddings
    if model_cfg.sliding_window:
        limit = min(limit, model_cfg.sliding_window)
    length = min(limit, 2048) if max_model_len is None else max_model_len
    if not 1 < length <= limit:
        raise ValueError(f"max_model_len must be in (1, {limit}] for this model, got {length}")
    tokenizer = model_files.load_tokenizer(model_dir)
    eos = model_files.eos_token_ids(model_dir, hf_config, tokenizer)
    return EngineConfig(
        model_dir,
        tensor_parallel_size,
        dtype,
        max_batch_size,
        length,
        max(max_num_batched_tokens, max_batch_size),
        eos,
        show_progress,
        remote_ranks,
        model_cfg.vocab_size,
        hf_config=hf_data,
    ), tokenizer


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], dict) and "role" in prompts[0]:
        return [prompts]  # type: ignore[list-item]  # one chat
    return prompts  # type: ignore[return-value]


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="guidespec: requests", unit="req")


def _close_engines(current: list[_Engine]) -> None:
    for engine in current:
        engine.close()


def _jump_forward_mode(value: bool | str) -> str:
    """True: "verified" (the default), False: "off", or a mode's name (config.JUMP_FORWARD_MODES)."""
    if isinstance(value, bool):
        return "verified" if value else "off"
    if value not in JUMP_FORWARD_MODES:
        raise ValueError(f"jump_forward must be True, False or one of {', '.join(JUMP_FORWARD_MODES)}, got {value!r}")
    return value


def _speculative_config(value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """``None`` (off), a method name (``"ngram"``), a dict of SpeculativeConfig fields, or the config."""
    if value is None:
        return None
    if isinstance(value, str):
        value = SpeculativeConfig(method=value)
    elif isinstance(value, dict):
        unknown = set(value) - {f.name for f in dataclasses.fields(SpeculativeConfig)}
        if unknown:
            raise ValueError(f"unknown speculative option(s): {', '.join(sorted(unknown))}")
        value = SpeculativeConfig(**value)
    value.validate()
    if value.method == "user":  # fail here, with the import error, not in the scheduler process
        from guidespec.scheduler.speculation.drafters import UserDrafter

        UserDrafter(value.user_drafter or "")
    draft = value.draft_model
    if value.method == "draft_model" and draft and draft not in ("self", "int8") and not draft.startswith("layers:"):
        value = dataclasses.replace(value, draft_model=str(model_files.resolve_model_dir(draft, show_progress=False)))
    if value.method == "eagle" and draft:
        from guidespec.worker.drafting.eagle_head import check_head_dir

        check_head_dir(Path(draft))  # a missing head fails here, in the client
        value = dataclasses.replace(value, draft_model=str(Path(draft).resolve()))
    return value
