"""The server's OpenAPI document: the pydantic models of request and response bodies, and the
error answers each route declares.

The models state the ranges ``protocol.validate_request`` enforces (``_documented``) but do not
check them: a value out of range is a 400 naming its field, not pydantic's 422. Turning a body
into an engine request is ``translate``'s job, not this module's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from guidespec.entrypoints.tools import MAX_TOOLS
from guidespec.protocol import (
    INT32_MAX,
    MAX_CHOICES,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
)

UNSUPPORTED = (
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
IGNORED = ("user", "store", "metadata", "service_tier")  # accepted, without effect


ROLES = ("system", "user", "assistant", "developer", "tool")


def _documented(default: Any = None, **schema: Any) -> Any:
    """A field whose OpenAPI schema states the range ``validate_request`` enforces; the check
    itself stays in ``validate_request`` (a 400 naming the field), not in pydantic."""
    return Field(default, json_schema_extra=schema)


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
ERRORS: dict[int | str, dict[str, Any]] = {
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
GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": CompletionResponse,
        "content": {"text/event-stream": {"schema": _SSE_EVENT}},
        "description": "the completion (JSON), or with stream: server-sent events",
    },
    **ERRORS,
}


class GenerateRequest(BaseModel):
    """Fields both endpoints take. Unknown fields are collected and refused with a 400 (the
    document says no others; OpenAI fields without effect here, ``IGNORED``, are accepted)."""

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


_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}


class CompletionRequest(GenerateRequest):
    # text or token ids, or a batch of one of them (OpenAI's four forms); any other value is a 400
    # naming the field (``translate.completion_prompt``), not pydantic's 422, which would also
    # take true for 1 and 1.0 for 1
    prompt: Any = _documented(
        ...,
        anyOf=[
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            _TOKEN_IDS,
            {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
        ],
    )


class ChatRequest(GenerateRequest):
    messages: list[dict[str, Any]] = _documented(
        ...,
        minItems=1,
        items={
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"enum": list(ROLES)},
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
