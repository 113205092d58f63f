"""The Python client: ``LLM`` starts an engine (scheduler + workers) and talks to it over ZeroMQ.

The client tokenizes (each form a prompt takes: ``prompts``) and validates: anything the engine
cannot serve (an empty or over-long prompt, a chat to a model without a chat template, bad
sampling parameters, a missing model, an unsupported architecture) raises here, before it
reaches the scheduler (the arguments and the model: ``launch.engine_config``). A receiver
thread routes the scheduler's output deltas (token ids) to per-request streams, which back the
blocking, streaming and asyncio forms alike; it makes their text on the way (``output_text``:
detokenizing and stop strings, off the scheduler's loop). Used as a context manager (or at
interpreter exit) it stops every process and removes every shared resource, also after Ctrl-C
or an exception.

When an engine process dies, every request in flight ends at once with ``EngineDeadError``
(the server's 503). With ``restart_on_failure`` (the server's default) a fresh engine then
starts in the background while new requests get ``EngineRestartingError``; a crash loop stops
the restarts and leaves the LLM dead (``launch.supervisor``: the engine's processes, their
deaths and restarts).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, Protocol, Sequence

import numpy as np

from guidespec.config import EngineConfig, SpeculativeConfig
from guidespec.launch import zygote
from guidespec.launch.engine_config import create_engine_config
from guidespec.launch.launcher import EngineProcesses
from guidespec.launch.supervisor import Engine, EngineDeadError, EngineRestartingError, EngineSupervisor
from guidespec.output_text import OutputText
from guidespec.prompts import Prompt, PromptEncoder, as_prompt_list, load_chat_template
from guidespec.protocol import (
    ENGINE_UNAVAILABLE,
    INTERNAL_ERROR,
    AbortRequest,
    DecodeStats,
    GenerateRequest,
    InvalidRequest,
    RequestOutput,
    RequestOutputs,
    SamplingParams,
    SchedulerStats,
    validate_request,
)

__all__ = [
    "LLM",
    "EngineClient",
    "EngineDeadError",
    "EngineRestartingError",
    "GenerationOutput",
    "RequestError",
    "RequestHandle",
    "StreamDelta",
]

logger = logging.getLogger(__name__)


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
    replica: str = ""  # data-parallel replicas: the one that served it (entrypoints/data_parallel.py)

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
    """Where one request's deltas land; read by a thread or an asyncio task. The receiver
    thread makes their text (``receive``) before it queues them."""

    def __init__(
        self, output: GenerationOutput, loop: asyncio.AbstractEventLoop | None = None, text: OutputText | None = None
    ) -> None:
        self.output = output
        self.text = text
        self.loop = loop
        self.queue: queue.Queue[RequestOutput] | asyncio.Queue[RequestOutput] = (
            asyncio.Queue() if loop else queue.Queue()
        )

    def receive(self, delta: RequestOutput) -> tuple[RequestOutput, bool]:
        """The receiver thread's part: the delta with its text (``OutputText``), ended there where
        that text holds a stop string; and whether the client ended it so (the engine is to abort
        it)."""
        text = self.text
        if text is None or (delta.error and delta.finish_reason == "error"):
            return delta, False
        try:
            if delta.restarted:
                text.restart()
            new_text, kept = text.add(delta.new_token_ids, delta.finished)
        except Exception:  # (the tokenizer raised on these tokens: this request alone fails)
            logger.exception("request %s: its text could not be made", delta.request_id)
            error = "internal error while decoding its text"
            failed = RequestOutput(delta.request_id, [], True, "error", error, error_status=INTERNAL_ERROR)
            return failed, not delta.finished
        if kept is None:
            return (dataclasses.replace(delta, new_text=new_text) if new_text else delta), False
        tokens = delta.new_token_ids[:kept]
        ended = dataclasses.replace(delta, new_token_ids=tokens, finished=True, finish_reason="stop", new_text=new_text)
        return ended, not delta.finished

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
        if delta.restarted:  # (the engine started it again: what came before is void)
            out.text, out.token_ids, out.first_token_time = "", [], 0.0
            out.grammar_backend = out.grammar_refusal = ""
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


class EngineClient(Protocol):
    """What the server needs of an engine: an ``LLM``, N of them (``entrypoints.data_parallel.EngineGroup``)
    or Ray Serve replicas (``entrypoints.ray_serve``)."""

    @property
    def config(self) -> EngineConfig: ...

    on_gave_up: Callable[[str], None] | None

    def encode_prompt(self, prompt: Prompt) -> list[int]: ...

    def open_stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, stream: bool = True
    ) -> RequestHandle: ...

    def check_alive(self) -> None: ...

    @property
    def gave_up(self) -> bool: ...

    @property
    def num_restarts(self) -> int: ...

    @property
    def scheduler_stats(self) -> SchedulerStats: ...


class LLM:
    """An engine on this machine. ``LLM()`` serves the embedded SmolLM2-135M-Instruct.

    ``chat_template``: the Jinja template chat prompts are rendered with, in place of the
    tokenizer's own: a file's path or the template's text (as vLLM's ``--chat-template``). A
    model without a template of its own (a base model) serves text and token-id prompts, and
    refuses chat prompts unless given one."""

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
        kv_block_size: int = 16,
        kv_cache_tokens: int | None = None,
        chat_template: str | os.PathLike[str] | None = None,
        grammar_cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if distributed_executor != "ray":  # (Ray's ranks are forked by no zygote of ours)
            zygote.warm_up_before_torch(device)  # its imports beside torch's, which resolving ``device`` needs
        template = load_chat_template(chat_template)
        self.config, self.tokenizer = create_engine_config(
            model,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            show_progress=show_progress,
            remote_ranks=remote_ranks,
            grammar_backend=grammar_backend,
            grammar_compile_timeout_s=grammar_compile_timeout_s,
            jump_forward=jump_forward,
            speculative=speculative,
            distributed_executor=distributed_executor,
            ray_address=ray_address,
            enable_prefix_caching=enable_prefix_caching,
            device=device,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            ray_placement=ray_placement,
            graph_grammar=graph_grammar,
            grammar_fill_threads=grammar_fill_threads,
            kv_block_size=kv_block_size,
            kv_cache_tokens=kv_cache_tokens,
            grammar_cache_dir=grammar_cache_dir,
        )
        self.prompts = PromptEncoder(self.tokenizer, self.config.vocab_size, self.config.max_model_len, template)
        # the receiver thread decodes with a tokenizer of its own, copied while the engine starts
        # (0.15-0.2 s here): a Rust tokenizer that two threads use may refuse one of them
        # ("Already borrowed": a call that changes its truncation while the other's holds it;
        # tokenizers#537, vllm#40949), and prompts are encoded on the caller's thread
        self._text_tokenizer: Any = None
        self._copying = threading.Thread(target=self._copy_tokenizer, name="guidespec-tokenizer-copy", daemon=True)
        self._copying.start()
        self.on_gave_up: Callable[[str], None] | None = None  # called (once) when the engine died for good
        self.scheduler_stats = SchedulerStats(0, 0, 0, max_batch_size)  # the queue, as the scheduler last said
        self._streams: dict[str, _RequestStream] = {}  # changed under the supervisor's state lock
        self._ids = itertools.count()
        self._supervisor = EngineSupervisor(
            self.config, restart_on_failure, self._route, self._fail_in_flight, self._give_up
        )
        try:
            self._supervisor.start()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ public API

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None, use_tqdm: bool = False
    ) -> list[GenerationOutput]:
        """Generate for one prompt or a list of them; a prompt is one of
        - a string: text, tokenized with the tokenizer's special tokens (a completion);
        - a list of chat messages (dicts with ``role`` and ``content``): rendered by the chat
          template (``chat_template``, else the tokenizer's own; a model without one refuses it);
        - a list of ints: token ids, checked against the vocabulary and ``max_model_len``;
        - ``{"prompt_token_ids": [...]}`` (token ids) or ``{"prompt": "..."}`` (text), as vLLM's.
        A list whose first item is an int is ONE prompt of token ids, and one whose first item is
        a message dict is one chat; any other list is several prompts (``[[1, 2], [3, 4]]``: two
        prompts of token ids; ``["a", [1, 2]]``: a text and token ids). A prompt of no such form,
        or one the engine cannot serve, raises ``InvalidRequest`` (a ``ValueError``)."""
        params = sampling_params or SamplingParams()
        streams: list[_RequestStream] = []
        try:
            for prompt in as_prompt_list(prompts):  # (a bad one aborts those sent before it)
                streams.append(self._submit(prompt, params, stream=False))
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
        if self._supervisor.is_healthy:
            self._engine.send(AbortRequest(request_id))

    @property
    def is_healthy(self) -> bool:
        """Serving now: not closed, not dead, not restarting."""
        return self._supervisor.is_healthy

    @property
    def gave_up(self) -> bool:
        """The engine died and will not be restarted (restarts off, or a crash loop)."""
        return self._supervisor.gave_up

    @property
    def restart_on_failure(self) -> bool:
        return self._supervisor.restart_on_failure

    @restart_on_failure.setter
    def restart_on_failure(self, value: bool) -> None:
        self._supervisor.restart_on_failure = value

    @property
    def num_kv_blocks(self) -> int:
        """The KV cache's pool, in blocks of :attr:`kv_block_size` positions (all requests together)."""
        ready = self._engine.ready
        return ready.num_kv_blocks if ready is not None else 0

    @property
    def kv_block_size(self) -> int:
        return self.config.kv_block_size

    @property
    def num_restarts(self) -> int:
        """Fresh engines started after a death."""
        return self._supervisor.num_restarts

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids for one prompt of any form ``generate`` takes (``prompts.PromptEncoder``):
        chat messages go through the chat template; a bad prompt raises ``InvalidRequest``."""
        return self.prompts.encode(prompt)

    def close(self) -> None:
        """Stop every process and remove every shared resource (``EngineSupervisor.close``)."""
        self._supervisor.close()

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
        ids = self.encode_prompt(prompt)
        validate_request(ids, params, self.config.vocab_size, self.config.max_model_len)
        request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        now = time.time()
        text = OutputText(self._decoding_tokenizer(), ids, params, self.config.eos_token_ids)
        request = _RequestStream(GenerationOutput(request_id, ids, arrival_time=now), loop, text)
        with self._supervisor.state_lock:  # a death after this fails the stream; one before it refuses it
            self._check_alive()
            self._streams[request_id] = request
            engine = self._engine
        engine.send(GenerateRequest(request_id, np.array(ids, dtype=np.int32), params, now, stream))
        return request

    def _copy_tokenizer(self) -> None:
        try:
            self._text_tokenizer = copy.deepcopy(self.tokenizer)
        except Exception:  # (the one tokenizer for both, then)
            logger.exception("the tokenizer could not be copied for decoding; prompts and outputs share it")

    def _decoding_tokenizer(self) -> Any:
        """The receiver thread's tokenizer (``_copy_tokenizer``), once it is made."""
        if self._text_tokenizer is None:
            self._copying.join()
        return self._text_tokenizer if self._text_tokenizer is not None else self.tokenizer

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
                with self._supervisor.state_lock:  # a death queues this stream's error before it marks the engine down
                    try:
                        self._check_alive()
                    except EngineDeadError:
                        try:
                            return stream.queue.get_nowait()  # type: ignore[return-value]
                        except queue.Empty:
                            raise

    def _route(self, message: object) -> None:
        """The receiver thread's handling of one scheduler message (``launch.supervisor.Engine._receive_loop``)."""
        if isinstance(message, RequestOutputs):
            # a step's deltas for streams on event loops go to each loop in one call: one wake of
            # it a step, not one a delta (64 streamed rows: the wakes were a quarter of the
            # client's samples, ``benchmarks/overhead.py --stream``)
            on_loops: dict[asyncio.AbstractEventLoop, list[tuple[_RequestStream, RequestOutput]]] = {}
            for output in message.outputs:
                if isinstance(output, RequestOutput):
                    self._route_one(output, on_loops)
            for loop, items in on_loops.items():
                try:
                    loop.call_soon_threadsafe(_put_all, items)
                except RuntimeError:  # its event loop is closed: nobody is waiting
                    pass
        elif isinstance(message, RequestOutput):
            self._route_one(message, None)
        elif isinstance(message, SchedulerStats):
            self.scheduler_stats = message

    def _route_one(
        self,
        output: RequestOutput,
        on_loops: dict[asyncio.AbstractEventLoop, list[tuple[_RequestStream, RequestOutput]]] | None,
    ) -> None:
        """One delta to its stream (``on_loops``: where those on event loops wait to be put)."""
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        delta, ended_here = stream.receive(output)
        if delta.finished:
            self._streams.pop(output.request_id, None)
        if on_loops is not None and stream.loop is not None:
            on_loops.setdefault(stream.loop, []).append((stream, delta))
        else:
            stream.put(delta)
        if ended_here:  # (its later deltas find no stream; the engine's abort answer neither)
            self.abort(output.request_id)

    def _fail_in_flight(self, message: str) -> None:
        """The engine died (``EngineSupervisor``, under its state lock): end every request in flight."""
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            request_id = stream.output.request_id
            stream.put(RequestOutput(request_id, [], True, "error", message, error_status=ENGINE_UNAVAILABLE))

    def _give_up(self, reason: str) -> None:
        if self.on_gave_up is not None:
            self.on_gave_up(reason)

    @property
    def _engine(self) -> Engine:
        """The live engine (a fresh one after each restart)."""
        assert self._supervisor.engine is not None, "the engine has not started"
        return self._supervisor.engine

    @property
    def _processes(self) -> EngineProcesses:
        """The live engine's processes (tests look at their pids and shared resources)."""
        return self._engine.processes

    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` (``EngineRestartingError`` while a fresh engine starts)
        unless the engine serves."""
        self._supervisor.check_alive()

    _check_alive = check_alive


def _put_all(items: list[tuple[_RequestStream, RequestOutput]]) -> None:
    """On an event loop: a step's deltas into their streams' queues."""
    for stream, delta in items:
        stream.queue.put_nowait(delta)  # type: ignore[arg-type]


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="guidespec: requests", unit="req")
