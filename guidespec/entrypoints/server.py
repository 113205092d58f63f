"""``guidespec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one ``LLM``.

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (the tokenizer's chat
template), both streaming over server-sent events; ``response_format`` (``json_schema``,
``json_object``) and the fields vLLM users send (``guided_json``, ``guided_regex``,
``guided_grammar``, ``guided_choice``, ``guided_decoding_backend``, ``top_k``,
``repetition_penalty``, ``ignore_eos``); ``/health``; ``/metrics`` for Prometheus.

Errors are OpenAI-style bodies (``{"error": {"message", "type", "param", "code"}}``) whose status
says whose fault it is: 400 for a request the engine refuses (invalid schema, context overflow,
bad or unsupported parameter), 401 for a wrong or missing API key (``--api-key`` guards the
``/v1`` routes, as vLLM's: ``/health`` and ``/metrics`` stay open), 404 for an unknown model or
route, 413 for a body over ``MAX_BODY_BYTES`` (by its ``Content-Length``, or counted as a chunked
upload arrives), 422 for a body of the wrong shape; 500 for a bug of ours
(its traceback in this server's log, never in the response), and 500 with ``code``
``"grammar_failed"`` where the grammar stopped before the output was complete (a backend's limit
met mid-way: there is no valid answer to give; ``X-Guidespec-Grammar-Restarts`` and
``usage.grammar_restarts`` count the times a request started again on the next backend
instead); 503 with ``Retry-After`` while the engine is restarting after a death, or while the
server drains for shutdown. A stream that fails after its first byte ends with an error event
of the same status (and code). The engine keeps serving the others. A client that disconnects
aborts its request, which frees its slot (``guidespec_num_requests_running`` in ``/metrics``).

The engine restarts itself (``LLM(restart_on_failure=True)``); if it dies in a crash loop the
server exits with a non-zero status, for its supervisor. SIGTERM (or Ctrl-C) drains: new
requests get 503, those in flight finish (up to ``shutdown_timeout_s``), then the engine stops.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import signal
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from guidespec.grammar_backends.interface import refusals_in
from guidespec.entrypoints.tools import MAX_TOOLS, ToolError, ToolPlan, history_content, plan_tools
from guidespec.llm import LLM, EngineDeadError, GenerationOutput, RequestError, RequestHandle, StreamDelta
from guidespec.protocol import (
    GRAMMAR_FAILED,
    INT32_MAX,
    MAX_CHOICES,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    GuidedDecoding,
    InvalidRequest,
    SamplingParams,
)

logger = logging.getLogger("guidespec.server")
MAX_BODY_BYTES = 16 << 20  # a request body past this is refused with 413 before it is read whole
RETRY_AFTER_S = 5  # what a 503 tells clients to wait (an engine restart takes a few seconds)

_UNSUPPORTED = (
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "functions",
    "function_call",
    "suffix",
    "best_of",
    "echo",
    "audio",
    "modalities",
    "prediction",
)
_IGNORED = ("user", "store", "metadata", "service_tier")  # accepted, without effect


_ROLES = ("system", "user", "assistant", "developer", "tool")


def _documented(default: Any = None, **schema: Any) -> Any:
    """A field whose OpenAPI schema states the range ``validate_request`` enforces; the check
    itself stays in ``validate_request`` (a 400 naming the field), not in pydantic."""
    return Field(default, json_schema_extra=schema)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str  # the HTTP status, or the failure's own kind ("grammar_failed")


class ErrorResponse(BaseModel):
    """Every error's body (OpenAI's shape)."""

    error: ErrorDetail


class CompletionResponse(BaseModel):
    """``/v1/completions`` and ``/v1/chat/completions`` answers (choices and usage as OpenAI's);
    with ``stream``, server-sent events of chunks instead."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any]


# one server-sent event (as OpenAPI 3.2 readers such as schemathesis parse a stream): its data is
# a chunk as JSON, an error object as JSON, or "[DONE]"
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in (
        (400, "the request is invalid or refused by the engine"),
        (401, "wrong or missing API key"),
        (404, "unknown model"),
        (413, "request body too large"),
        (422, "request body of the wrong shape"),
        (500, "a bug of the server (the traceback is in its log)"),
        (503, "the engine is restarting or the server is shutting down: retry after Retry-After seconds"),
    )
}
_GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": CompletionResponse,
        "content": {"text/event-stream": {"schema": _SSE_EVENT}},
        "description": "the completion (JSON), or with stream: server-sent events",
    },
    **_ERRORS,
}


class _Request(BaseModel):
    """Fields both endpoints take. Unknown fields are collected and refused with a 400 (the
    document says no others; OpenAI fields without effect here, ``_IGNORED``, are accepted)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})
    model: str | None = None
    max_tokens: int | None = _documented(minimum=1)
    temperature: float | None = _documented(minimum=0, maximum=MAX_TEMPERATURE)
    top_p: float | None = _documented(exclusiveMinimum=0, maximum=1)
    top_k: int | None = _documented(minimum=-1, maximum=INT32_MAX)
    n: int = _documented(1, minimum=1, maximum=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = _documented(maxItems=MAX_STOP_STRINGS, minLength=1, maxLength=MAX_STOP_CHARS)
    seed: int | None = _documented(minimum=0, maximum=2**63 - 1)
    presence_penalty: float = _documented(0.0, minimum=-2, maximum=2)
    frequency_penalty: float = _documented(0.0, minimum=-2, maximum=2)
    repetition_penalty: float = _documented(1.0, minimum=MIN_REPETITION_PENALTY, maximum=MAX_REPETITION_PENALTY)
    ignore_eos: bool = False
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = _documented(minItems=1, maxItems=MAX_CHOICES)
    guided_decoding_backend: Literal["auto", "xgrammar", "llguidance"] | None = None
    speculative: bool = True  # guidespec: False turns the engine's drafter off for this request


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]] = _documented(..., minLength=1, minItems=1)


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = _documented(
        ...,
        minItems=1,
        items={
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"enum": list(_ROLES)},
                "content": {
                    "anyOf": [
                        {"type": "null"},  # (an assistant message that made tool calls)
                        {"type": "string"},
                        {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["type", "text"],
                                "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                            },
                        },
                    ]
                },
            },
        },
    )
    max_completion_tokens: int | None = _documented(minimum=1)
    # (checked in tools.plan_tools: a 400 naming the field)
    tools: list[dict[str, Any]] | None = _documented(minItems=1, maxItems=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class _Metrics:
    def __init__(self, llm: LLM) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_RestartCollector(llm))
        latency_buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram(
            "guidespec_time_to_first_token_seconds", "Time to first token", registry=r, buckets=latency_buckets
        )
        self.itl = Histogram(
            "guidespec_inter_token_latency_seconds",
            "Time per output token after the first",
            registry=r,
            buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
        )
        self.e2e = Histogram(
            "guidespec_e2e_request_latency_seconds", "End-to-end request latency", registry=r, buckets=latency_buckets
        )
        self.accepted = Histogram(
            "guidespec_accepted_tokens_per_step",
            "Tokens per step of speculating requests (the target's own token included)",
            registry=r,
            buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8),
        )
        self.finished = Counter(
            "guidespec_request_success", "Requests finished, by reason", ["finished_reason"], registry=r
        )
        self.failed = Counter(
            "guidespec_request_failure", "Requests refused or failed, by HTTP status", ["status"], registry=r
        )
        self.refusals = Counter(
            "guidespec_grammar_refusals",
            "Grammars a backend refused (it cannot enforce them "
            "exactly), by backend and the keyword it named; with backend auto the other one "
            "may have served the request",
            ["backend", "keyword"],
            registry=r,
        )
        self.grammar_failures = Counter(
            "guidespec_grammar_failures",
            "Grammars that stopped before their output was complete (a backend's limit met "
            "mid-way), by backend and outcome: the request failed (grammar_failed) or started "
            "again on the next backend of auto (restarted)",
            ["backend", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter("guidespec_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("guidespec_generation_tokens", "Generated tokens", registry=r)
        self.in_server = Gauge("guidespec_num_requests_in_server", "HTTP requests being served", registry=r)
        for field, doc in (
            ("running", "Requests holding a KV slot"),
            ("waiting", "Requests queued for a slot (queue depth)"),
            ("waiting_for_grammar", "Requests waiting for their grammar to compile"),
        ):
            gauge = Gauge(f"guidespec_num_requests_{field}", doc, registry=r)
            gauge.set_function(_stat_reader(llm, field))

    def count_refusals(self, message: str) -> None:
        for backend, keyword in refusals_in(message):
            self.refusals.labels(backend=backend, keyword=keyword).inc()

    def count_grammar_failure(self, e: Exception) -> None:
        """A request that failed with ``grammar_failed``, by the backend its message names."""
        if isinstance(e, RequestError) and e.code == GRAMMAR_FAILED:
            for backend in _GAVE_UP.findall(str(e))[-1:]:
                self.grammar_failures.labels(backend=backend, outcome="failed").inc()

    def observe(self, out: GenerationOutput) -> None:
        self.count_refusals(out.grammar_refusal)
        for backend in _GAVE_UP.findall(out.grammar_refusal)[: out.stats.grammar_restarts]:
            self.grammar_failures.labels(backend=backend, outcome="restarted").inc()
        self.finished.labels(finished_reason=out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        if out.first_token_time:
            self.ttft.observe(out.time_to_first_token_s)
            if len(out.token_ids) > 1:
                self.itl.observe((out.finish_time - out.first_token_time) / (len(out.token_ids) - 1))
        self.e2e.observe(out.latency_s)
        if out.stats.num_spec_steps:
            self.accepted.observe(out.stats.mean_accepted_tokens_per_step)


_GAVE_UP = re.compile(r"\b(xgrammar|llguidance) gave up:")  # a grammar failure's backend (GrammarManager.error)


def _stat_reader(llm: LLM, field: str) -> Any:
    return lambda: float(getattr(llm.scheduler_stats, field))


class _RestartCollector:
    """``guidespec_engine_restarts_total``: fresh engines started after a death (counted by the LLM)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "guidespec_engine_restarts", "Engine restarts after a process died", value=self.llm.num_restarts
        )


class _BodyLimit:
    """ASGI middleware: reads each request's body as it arrives, counting its bytes, and answers
    413 as soon as they pass ``max_bytes`` (a chunked upload has no ``Content-Length`` to check
    up front); the rest is not read. A body within the limit reaches the app as one message."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_refused: Callable[[], None]) -> None:
        self.app, self.max_bytes, self.on_refused = app, max_bytes, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body was whole: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                self.on_refused()
                refusal = _error(413, f"the request body passed {self.max_bytes} bytes (the limit)")
                await refusal(scope, receive, send)
                return
            more = message.get("more_body", False)
        pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:  # the body, then the connection's own messages (a disconnect)
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)


def create_app(llm: LLM, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``llm`` under the name ``model_name``."""
    app = FastAPI(title="guidespec", docs_url=None, redoc_url=None)
    metrics = _Metrics(llm)
    max_model_len = llm.config.max_model_len
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        metrics.failed.labels(status=str(e.status)).inc()
        return _error(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        metrics.failed.labels(status="422").inc()
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return _error(422, f"{where or 'body'}: {first.get('msg', 'invalid request body')}", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=e)
        metrics.failed.labels(status="500").inc()
        return _error(500, f"internal server error ({type(e).__name__}); the details are in the server's log")

    # (added first, so it runs inside _admit: a body is read only once its request is admitted)
    app.add_middleware(
        _BodyLimit, max_bytes=MAX_BODY_BYTES, on_refused=lambda: metrics.failed.labels(status="413").inc()
    )

    @app.middleware("http")
    async def _admit(request: Request, call_next: Any) -> Any:
        """Authentication (the ``/v1`` routes), a ``Content-Length`` over the body size limit, and
        503 while the server drains for shutdown."""
        if request.url.path.startswith("/v1"):
            if api_key and not _authorized(request.headers.get("authorization", ""), api_key):
                metrics.failed.labels(status="401").inc()
                return _error(401, "invalid or missing API key (send Authorization: Bearer <key>)")
            if app.state.draining:
                metrics.failed.labels(status="503").inc()
                return _error(503, "the server is shutting down")
            length = request.headers.get("content-length", "")
            if length.isdigit() and int(length) > MAX_BODY_BYTES:
                metrics.failed.labels(status="413").inc()
                return _error(413, f"the request body has {length} bytes; the limit is {MAX_BODY_BYTES}")
        return await call_next(request)

    app.state.draining = False

    @app.get("/health", responses={200: {"description": "serving"}, 503: _ERRORS[503]})
    async def health() -> JSONResponse:
        try:
            llm._check_alive()
        except EngineDeadError as e:
            return _error(503, str(e))
        if app.state.draining:
            return _error(503, "the server is shutting down")
        return JSONResponse({"status": "ok"})

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus' text format", "content": {"text/plain": {}}}},
    )
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": model_name,
                        "object": "model",
                        "created": created,
                        "owned_by": "guidespec",
                        "max_model_len": max_model_len,
                    }
                ],
            }
        )

    @app.post("/v1/completions", responses=_GENERATE_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(
                    400,
                    "one prompt per request is supported (got a batch of "
                    f"{len(prompt)}); send them as separate requests",
                    "prompt",
                )
            prompt = prompt[0]
        engine_prompt: Any = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
        return await _serve(body, engine_prompt, request, chat=False, default_max_tokens=16)

    @app.post("/v1/chat/completions", responses=_GENERATE_RESPONSES)
    async def chat(body: ChatRequest, request: Request) -> Any:
        try:
            tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
            messages = [_chat_message(m, i) for i, m in enumerate(body.messages)]
        except ToolError as e:
            raise APIError(400, str(e), e.param) from None
        if tools is not None:
            messages = tools.prompt(messages)
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        return await _serve(body, messages, request, chat=True, default_max_tokens=None, tools=tools)

    async def _serve(
        body: _Request,
        prompt: Any,
        request: Request,
        chat: bool,
        default_max_tokens: int | None,
        tools: ToolPlan | None = None,
    ) -> Any:
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{model_name}`", "model")
        extra = sorted(set(body.model_extra or {}) - set(_IGNORED))
        unsupported = [k for k in extra if k in _UNSUPPORTED and (body.model_extra or {}).get(k) not in (None, False)]
        unknown = [k for k in extra if k not in _UNSUPPORTED]
        if unsupported or unknown:
            what = ([f"unsupported parameter(s): {', '.join(unsupported)}"] if unsupported else []) + (
                [f"unknown parameter(s): {', '.join(unknown)}"] if unknown else []
            )
            raise APIError(400, "; ".join(what), (unsupported or unknown)[0])
        if body.n != 1:
            raise APIError(400, f"n must be 1 (got {body.n}): send several requests instead", "n")
        try:
            prompt_ids = llm.encode_prompt(prompt)
        except Exception as e:
            raise APIError(400, f"cannot tokenize the prompt: {e}", "messages" if chat else "prompt") from None
        room = max_model_len - len(prompt_ids)
        if room <= 0 or (body.max_tokens is not None and body.max_tokens > room):
            asked = body.max_tokens if body.max_tokens is not None else 0
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {len(prompt_ids) + asked} tokens ({len(prompt_ids)} in the prompt, "
                f"{asked} for the completion). Shorten the prompt or lower max_tokens.",
                "max_tokens",
            )
        max_tokens = body.max_tokens if body.max_tokens is not None else min(default_max_tokens or room, room)
        params = _sampling_params(body, max_tokens, llm.config.grammar_backend, tools)
        try:
            # (not streamed: the output comes whole, so the engine may start it again on another backend)
            handle = llm.open_stream({"prompt_token_ids": prompt_ids}, params, stream=body.stream)
        except InvalidRequest as e:
            raise APIError(400, str(e), e.param) from None
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        except EngineDeadError as e:
            raise APIError(503, str(e)) from None
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        metrics.in_server.inc()
        try:
            if body.stream:
                first = await _first_delta(handle)  # a grammar the engine refuses answers 400 before any byte
                include_usage = bool((body.stream_options or {}).get("include_usage"))
                return StreamingResponse(
                    _sse(handle, first, request_id, chat, include_usage, metrics, tools),
                    media_type="text/event-stream",
                    headers=_served_by(handle.output),
                )
            output = await _collect(handle, request)
        finally:
            if not body.stream:
                metrics.in_server.dec()
        if output is None:  # the client went away: the request was aborted
            return JSONResponse({}, status_code=499)
        metrics.observe(output)
        return JSONResponse(_response(output, request_id, chat, tools), headers=_served_by(output))

    async def _sse(
        handle: RequestHandle,
        first: StreamDelta,
        request_id: str,
        chat: bool,
        include_usage: bool,
        metrics: _Metrics,
        tools: ToolPlan | None = None,
    ) -> AsyncIterator[str]:
        """Server-sent events; if the client disconnects, the generator is closed and ``deltas()``
        (closed with it) aborts the request. With tools, text is held back until the output shows
        whether it is calls; calls go out whole at the end, in one delta."""
        deltas = handle.deltas()
        holding = tools is not None and tools.calls_tools  # the output so far may be tool calls
        held = ""
        try:
            if chat:
                yield _event(_chunk(request_id, chat, {"role": "assistant", "content": ""}, None))
            delta: StreamDelta | None = first
            while delta is not None:
                reason = _finish_reason(delta.finish_reason) if delta.finished else None
                text = delta.text
                if holding and tools is not None:
                    held += text
                    if tools.may_call(held) is False:  # text: what was held goes out, the rest streams
                        text, holding = held, False
                    elif delta.finished:
                        message, reason = tools.reply(held, reason or "stop")
                        yield _event(_chunk(request_id, chat, _stream_message(message), reason))
                        break
                    else:
                        text = ""
                if text or reason:
                    yield _event(_chunk(request_id, chat, {"content": text} if chat else text, reason))
                if delta.finished:
                    break
                try:
                    delta = await deltas.__anext__()
                except StopAsyncIteration:
                    delta = None
                except Exception as e:  # the stream has begun: its status went out; end with an error event
                    metrics.count_grammar_failure(e)
                    yield _error_event(e)
                    return
            out = handle.output
            metrics.observe(out)
            if include_usage:
                yield _event(
                    {
                        "id": request_id,
                        "object": _object(chat, stream=True),
                        "created": int(time.time()),
                        "model": model_name,
                        "choices": [],
                        "usage": _usage(out),
                    }
                )
            yield "data: [DONE]\n\n"
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]
            metrics.in_server.dec()

    async def _first_delta(handle: RequestHandle) -> StreamDelta:
        try:
            return await handle.deltas().__anext__()
        except (RequestError, EngineDeadError) as e:
            await handle.deltas().aclose()  # type: ignore[attr-defined]
            metrics.in_server.dec()
            metrics.count_refusals(_engine_message(e))
            metrics.count_grammar_failure(e)
            raise APIError(_status(e), _engine_message(e), code=_code(e)) from None

    async def _collect(handle: RequestHandle, request: Request) -> GenerationOutput | None:
        """The whole output; None if the client disconnected first (the request is then aborted)."""

        async def drain() -> None:
            async for _ in handle.deltas():
                pass

        task = asyncio.ensure_future(drain())
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if not done and await request.is_disconnected():
                    task.cancel()  # cancelling the drain closes deltas(): the request is aborted
                    return None
            task.result()
        except (RequestError, EngineDeadError) as e:
            metrics.count_refusals(_engine_message(e))
            metrics.count_grammar_failure(e)
            raise APIError(_status(e), _engine_message(e), code=_code(e)) from None
        return handle.output

    def _chunk(request_id: str, chat: bool, content: Any, reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
        if chat:
            choice["delta"] = content
        else:
            choice["text"] = content
            choice["logprobs"] = None
        return {
            "id": request_id,
            "object": _object(chat, stream=True),
            "created": int(time.time()),
            "model": model_name,
            "choices": [choice],
        }

    def _response(out: GenerationOutput, request_id: str, chat: bool, tools: ToolPlan | None) -> dict[str, Any]:
        reason = _finish_reason(out.finish_reason)
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": out.text}
            if tools is not None:
                message, reason = tools.reply(out.text, reason)
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": out.text, "finish_reason": reason, "logprobs": None}
        return {
            "id": request_id,
            "object": _object(chat, stream=False),
            "created": int(time.time()),
            "model": model_name,
            "choices": [choice],
            "usage": _usage(out),
        }

    return app


def _sampling_params(
    body: _Request, max_tokens: int, default_backend: str, tools: ToolPlan | None = None
) -> SamplingParams:
    guided = _guided(body)
    if tools is not None and tools.calls_tools:
        if guided is not None:
            raise APIError(400, "tools (tool_choice other than none) take no other constraint", "tool_choice")
        guided = tools.guided()
        assert guided is not None
        if body.guided_decoding_backend not in (None, "auto"):
            if guided.backend is not None and guided.backend != body.guided_decoding_backend:
                raise APIError(400, 'tool_choice "auto" is enforced by llguidance', "guided_decoding_backend")
            guided = GuidedDecoding(**{**guided.__dict__, "backend": body.guided_decoding_backend})
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k in (None, -1) else body.top_k,  # vLLM's -1: off
            seed=body.seed,
            stop=tuple(stop),
            ignore_eos=body.ignore_eos,
            guided=guided,
            repetition_penalty=body.repetition_penalty,
            frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty,
            speculative=body.speculative,
        )
        params.validate()
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return params


def _guided(body: _Request) -> GuidedDecoding | None:
    """The request's one constraint, from ``response_format`` or the ``guided_*`` fields."""
    found: list[tuple[str, GuidedDecoding]] = []
    fmt = body.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_schema":
            spec = fmt.get("json_schema") or {}
            if not isinstance(spec, dict):
                raise APIError(400, "response_format.json_schema must be an object with a schema", "response_format")
            schema = spec.get("schema", spec.get("json_schema"))
            if schema is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format")
            found.append(
                (
                    "response_format",
                    GuidedDecoding(json_schema=schema if isinstance(schema, str) else json.dumps(schema)),
                )
            )
        elif kind == "json_object":
            found.append(("response_format", GuidedDecoding(json_object=True)))
        elif kind not in ("text", None):
            raise APIError(
                400, f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format"
            )
    if body.guided_json is not None:
        schema = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
        found.append(("guided_json", GuidedDecoding(json_schema=schema)))
    if body.guided_regex is not None:
        found.append(("guided_regex", GuidedDecoding(regex=body.guided_regex)))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", GuidedDecoding(grammar=body.guided_grammar)))
    if body.guided_choice is not None:
        found.append(("guided_choice", GuidedDecoding(choice=tuple(body.guided_choice))))
    if len(found) > 1:
        raise APIError(
            400, f"at most one constraint per request, got {', '.join(name for name, _ in found)}", found[1][0]
        )
    if not found:
        return None
    name, guided = found[0]
    if body.guided_decoding_backend is not None:
        guided = GuidedDecoding(**{**guided.__dict__, "backend": body.guided_decoding_backend})
    try:
        guided.validate()
    except ValueError as e:
        raise APIError(400, f"{name}: {e}", name) from None
    return guided


def _chat_message(message: dict[str, Any], index: int) -> dict[str, str]:
    role, content = message.get("role"), message.get("content")
    if role not in _ROLES:
        raise APIError(400, f"messages[{index}].role must be one of {', '.join(_ROLES)}, got {role!r}", "messages")
    if role == "assistant" and message.get("tool_calls") is not None:
        if not isinstance(content, (str, type(None))):
            raise APIError(400, f"messages[{index}].content must be a string or null", "messages")
        return {"role": role, "content": history_content(message, index)}
    if isinstance(content, list):  # content parts: only text is supported
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise APIError(400, f"messages[{index}]: only text content parts are supported", "messages")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    if not isinstance(content, str):
        raise APIError(400, f"messages[{index}].content must be a string or text parts", "messages")
    return {"role": "system" if role == "developer" else role, "content": content}


def _stream_message(message: dict[str, Any]) -> dict[str, Any]:
    """A whole assistant message as a stream's delta (tool calls carry their index)."""
    if message.get("tool_calls") is None:
        return {"content": message["content"]}
    return {"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}


def _authorized(header: str, api_key: str) -> bool:
    """``Authorization: Bearer <key>`` as vLLM checks it: the scheme in any case (RFC 9110 11.1),
    the key compared in constant time."""
    scheme, _, key = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(key.encode(), api_key.encode())


def _status(e: Exception) -> int:
    """The HTTP status of an engine's error: 503 for a dead or restarting engine, else its own."""
    if isinstance(e, EngineDeadError):
        return 503
    return e.status if isinstance(e, RequestError) else 500


def _error_event(e: Exception) -> str:
    """The last event of a stream that failed after it began."""
    if not isinstance(e, (RequestError, EngineDeadError)):
        logger.error("a stream failed", exc_info=e)
        message = f"internal server error ({type(e).__name__}); the details are in the server's log"
    else:
        message = _engine_message(e)
    status = _status(e)
    return _event(
        {
            "error": {
                "message": message,
                "type": _ERROR_TYPES.get(status, "APIError"),
                "param": None,
                "code": _code(e) or status,
            }
        }
    )


def _code(e: Exception) -> str:
    """An engine error's own kind (``"grammar_failed"``), or ""."""
    return e.code if isinstance(e, RequestError) else ""


def _engine_message(e: Exception) -> str:
    """The engine's refusal without our request id prefix."""
    text = str(e)
    return text.split(": ", 1)[1] if text.startswith("request ") and ": " in text else text


def _finish_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _object(chat: bool, stream: bool) -> str:
    if chat:
        return "chat.completion.chunk" if stream else "chat.completion"
    return "text_completion"


def _served_by(out: GenerationOutput) -> dict[str, str] | None:
    """The response headers naming the grammar backend that enforced a guided request, and how
    many times it started again on the next one after a grammar failed mid-way (where it did)."""
    if not out.grammar_backend:
        return None
    headers = {"X-Guidespec-Grammar-Backend": out.grammar_backend}
    if out.stats.grammar_restarts:
        headers["X-Guidespec-Grammar-Restarts"] = str(out.stats.grammar_restarts)
    return headers


def _usage(out: GenerationOutput) -> dict[str, Any]:
    """OpenAI's usage, plus guidespec's decoding figures (extra fields, which OpenAI clients ignore):
    target ``steps``, ``spec_steps`` (steps that verified drafts) and ``accepted_tokens_per_step``
    (tokens per speculative step, the target's own token included; 1.0 without speculation)."""
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    stats = out.stats
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "steps": stats.num_steps,
        "spec_steps": stats.num_spec_steps,
        "accepted_tokens_per_step": round(stats.mean_accepted_tokens_per_step, 4),
        **({"grammar_backend": out.grammar_backend} if out.grammar_backend else {}),
        **({"grammar_restarts": stats.grammar_restarts} if stats.grammar_restarts else {}),
    }


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def _error(status: int, message: str, param: str | None = None, code: str = "") -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(
        {
            "error": {
                "message": message,
                "type": _ERROR_TYPES.get(status, "APIError"),
                "param": param,
                "code": code or status,
            }
        },
        status_code=status,
        headers=headers,
    )


def run_server(
    llm: LLM,
    model_name: str,
    host: str,
    port: int,
    api_key: str | None,
    log_level: str = "warning",
    shutdown_timeout_s: float = 30.0,
) -> int:
    """Serve until SIGTERM / Ctrl-C (0) or until the engine gives up after a crash loop (1)."""
    import uvicorn

    app = create_app(llm, model_name, api_key)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.draining = True  # new requests: 503; those in flight finish
            super().handle_exit(sig, frame)
            # uvicorn raises a caught signal again once it has drained: SIGTERM's default action
            # would end this process before the engine is stopped and its shared memory removed
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    server = _Server(
        uvicorn.Config(
            app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=max(1, round(shutdown_timeout_s))
        )
    )

    def give_up(reason: str) -> None:
        logger.error("the engine died in a crash loop (%s); the server exits", reason)
        app.state.draining = True
        server.should_exit = True

    llm.on_gave_up = give_up
    server.run()
    return 1 if llm.gave_up else 0
