"""The server's routes: ``/health``, ``/metrics``, ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions``; a generation runs on the engine here, answered whole or streamed as
server-sent events, and aborted when its client disconnects.

What the routes share (the ``LLM``, its name, the metrics) is a ``ServerContext`` on
``app.state.context``, set by ``create_app``. Checking a body and writing the answer's JSON is
``translate``'s job; authentication, the body size limit and draining are the app's middleware.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from guidespec.entrypoints.server.errors import APIError, engine_message, error_response, refused
from guidespec.entrypoints.server.metrics import ServerMetrics
from guidespec.entrypoints.server.schemas import (
    ERRORS,
    GENERATE_RESPONSES,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
)
from guidespec.entrypoints.server.translate import (
    chat_prompt,
    check_request,
    chunk,
    completion_prompt,
    error_event,
    event,
    finish_reason,
    max_tokens_for,
    response,
    sampling_params,
    served_by,
    stream_message,
    usage_chunk,
)
from guidespec.entrypoints.tools import ToolPlan
from guidespec.llm import EngineClient, EngineDeadError, GenerationOutput, RequestError, RequestHandle, StreamDelta
from guidespec.protocol import InvalidRequest


@dataclass(frozen=True)
class ServerContext:
    """What every route reads: the engine, the name it is served under, and the metrics."""

    llm: EngineClient
    model_name: str
    metrics: ServerMetrics
    api_key: str | None
    max_model_len: int
    created: int  # when the server started: /v1/models' "created"


router = APIRouter()


def _context(request: Request) -> ServerContext:
    context: ServerContext = request.app.state.context
    return context


@router.get("/health", responses={200: {"description": "serving"}, 503: ERRORS[503]})
async def health(request: Request) -> JSONResponse:
    try:
        _context(request).llm.check_alive()
    except EngineDeadError as e:
        return error_response(503, str(e))
    if request.app.state.draining:
        return error_response(503, "the server is shutting down")
    return JSONResponse({"status": "ok"})


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"description": "Prometheus' text format", "content": {"text/plain": {}}}},
)
async def prometheus(request: Request) -> PlainTextResponse:
    registry = _context(request).metrics.registry
    return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    context = _context(request)
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": context.model_name,
                    "object": "model",
                    "created": context.created,
                    "owned_by": "guidespec",
                    "max_model_len": context.max_model_len,
                }
            ],
        }
    )


@router.post("/v1/completions", responses=GENERATE_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Any:
    engine_prompt = completion_prompt(body.prompt)
    return await _serve(_context(request), body, engine_prompt, request, chat=False, default_max_tokens=16)


@router.post("/v1/chat/completions", responses=GENERATE_RESPONSES)
async def chat(body: ChatRequest, request: Request) -> Any:
    messages, tools = chat_prompt(body)
    if body.max_completion_tokens is not None and body.max_tokens is None:
        body.max_tokens = body.max_completion_tokens
    return await _serve(_context(request), body, messages, request, chat=True, default_max_tokens=None, tools=tools)


async def _serve(
    context: ServerContext,
    body: GenerateRequest,
    prompt: Any,
    request: Request,
    chat: bool,
    default_max_tokens: int | None,
    tools: ToolPlan | None = None,
) -> Any:
    """One generation: checked, opened on the engine, then streamed or answered whole."""
    llm, metrics = context.llm, context.metrics
    check_request(body, context.model_name)
    try:
        prompt_ids = llm.encode_prompt(prompt)
    except InvalidRequest as e:  # (a chat to a model without a chat template, token ids out of the vocabulary)
        raise APIError(400, str(e), e.param) from None
    except Exception as e:
        raise APIError(400, f"cannot tokenize the prompt: {e}", "messages" if chat else "prompt") from None
    max_tokens = max_tokens_for(body, len(prompt_ids), context.max_model_len, default_max_tokens)
    params = sampling_params(body, max_tokens, llm.config.grammar_backend, tools)
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
            first = await _first_delta(handle, metrics)  # a grammar the engine refuses answers 400 before any byte
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(
                _sse(context, handle, first, request_id, chat, include_usage, tools),
                media_type="text/event-stream",
                headers=served_by(handle.output),
            )
        output = await _collect(handle, request, metrics)
    finally:
        if not body.stream:
            metrics.in_server.dec()
    if output is None:  # the client went away: the request was aborted
        return JSONResponse({}, status_code=499)
    metrics.observe(output)
    return JSONResponse(response(output, request_id, context.model_name, chat, tools), headers=served_by(output))


async def _sse(
    context: ServerContext,
    handle: RequestHandle,
    first: StreamDelta,
    request_id: str,
    chat: bool,
    include_usage: bool,
    tools: ToolPlan | None = None,
) -> AsyncIterator[str]:
    """Server-sent events; if the client disconnects, the generator is closed and ``deltas()``
    (closed with it) aborts the request. With tools, text is held back until the output shows
    whether it is calls; calls go out whole at the end, in one delta."""
    metrics, model_name = context.metrics, context.model_name
    deltas = handle.deltas()
    holding = tools is not None and tools.calls_tools  # the output so far may be tool calls
    held = ""
    try:
        if chat:
            yield event(chunk(request_id, model_name, chat, {"role": "assistant", "content": ""}, None))
        delta: StreamDelta | None = first
        while delta is not None:
            reason = finish_reason(delta.finish_reason) if delta.finished else None
            text = delta.text
            if holding and tools is not None:
                held += text
                if tools.may_call(held) is False:  # text: what was held goes out, the rest streams
                    text, holding = held, False
                elif delta.finished:
                    message, reason = tools.reply(held, reason or "stop")
                    yield event(chunk(request_id, model_name, chat, stream_message(message), reason))
                    break
                else:
                    text = ""
            if text or reason:
                yield event(chunk(request_id, model_name, chat, {"content": text} if chat else text, reason))
            if delta.finished:
                break
            try:
                delta = await deltas.__anext__()
            except StopAsyncIteration:
                delta = None
            except Exception as e:  # the stream has begun: its status went out; end with an error event
                metrics.count_grammar_failure(e)
                yield error_event(e)
                return
        out = handle.output
        metrics.observe(out)
        if include_usage:
            yield event(usage_chunk(out, request_id, model_name, chat))
        yield "data: [DONE]\n\n"
    finally:
        await deltas.aclose()  # type: ignore[attr-defined]
        metrics.in_server.dec()


async def _first_delta(handle: RequestHandle, metrics: ServerMetrics) -> StreamDelta:
    try:
        return await handle.deltas().__anext__()
    except (RequestError, EngineDeadError) as e:
        await handle.deltas().aclose()  # type: ignore[attr-defined]
        metrics.in_server.dec()
        metrics.count_refusals(engine_message(e))
        metrics.count_grammar_failure(e)
        raise refused(e) from None


async def _collect(handle: RequestHandle, request: Request, metrics: ServerMetrics) -> GenerationOutput | None:
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
        metrics.count_refusals(engine_message(e))
        metrics.count_grammar_failure(e)
        raise refused(e) from None
    return handle.output
