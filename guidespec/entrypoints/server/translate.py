"""OpenAI's API to the engine's and back: a request body checked and turned into a prompt and
``SamplingParams`` (its constraint a ``GuidedDecoding``); an engine's ``GenerationOutput`` turned
into a response, its deltas into stream chunks, a failure mid-stream into an error event.

Every refusal here is the client's fault: an ``APIError`` with a 4xx status naming the field.
Running the request (the engine, the stream, disconnects) is the routes' job, not this module's.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from guidespec.entrypoints.server.errors import ERROR_TYPES, APIError, code_of, engine_message, status_of
from guidespec.entrypoints.server.schemas import IGNORED, ROLES, UNSUPPORTED, ChatRequest, GenerateRequest
from guidespec.entrypoints.tools import ToolError, ToolPlan, history_content, plan_tools
from guidespec.llm import EngineDeadError, GenerationOutput, RequestError
from guidespec.protocol import GuidedDecoding, SamplingParams

logger = logging.getLogger("guidespec.server")


def check_request(body: GenerateRequest, model_name: str) -> None:
    """The model it names, its fields (unknown or unsupported: 400) and ``n``."""
    if body.model is not None and body.model != model_name:
        raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{model_name}`", "model")
    extra = sorted(set(body.model_extra or {}) - set(IGNORED))
    unsupported = [k for k in extra if k in UNSUPPORTED and (body.model_extra or {}).get(k) not in (None, False)]
    unknown = [k for k in extra if k not in UNSUPPORTED]
    if unsupported or unknown:
        what = ([f"unsupported parameter(s): {', '.join(unsupported)}"] if unsupported else []) + (
            [f"unknown parameter(s): {', '.join(unknown)}"] if unknown else []
        )
        raise APIError(400, "; ".join(what), (unsupported or unknown)[0])
    if body.n != 1:
        raise APIError(400, f"n must be 1 (got {body.n}): send several requests instead", "n")


def completion_prompt(prompt: Any) -> str | dict[str, list[int]]:
    """``/v1/completions``' prompt as the engine takes it: text (a string) or token ids (a list of
    ints), or a batch of one of them (a list of one string or of one list of ints). Anything else
    is a 400 naming the field; token ids are checked against the vocabulary by the engine's
    client (``prompts.PromptEncoder``)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise APIError(
                400,
                f"one prompt per request is supported (got a batch of {len(prompt)}); send them as separate requests",
                "prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):  # (not bool, not float)
        return {"prompt_token_ids": prompt}
    raise APIError(
        400,
        "prompt must be a string, a list of token ids (integers) or a list of one of these; got "
        + _prompt_shape(prompt),
        "prompt",
    )


def chat_prompt(body: ChatRequest) -> tuple[list[dict[str, str]], ToolPlan | None]:
    """``/v1/chat/completions``' messages for the chat template (the tools described in them),
    and the plan for its tools, if it has any."""
    try:
        tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        messages = [_chat_message(m, i) for i, m in enumerate(body.messages)]
    except ToolError as e:
        raise APIError(400, str(e), e.param) from None
    if tools is not None:
        messages = tools.prompt(messages)
    return messages, tools


def max_tokens_for(body: GenerateRequest, num_prompt_tokens: int, max_model_len: int, default: int | None) -> int:
    """The request's ``max_tokens``, or the default within the room its prompt leaves; a 400 if
    it does not fit."""
    room = max_model_len - num_prompt_tokens
    if room <= 0 or (body.max_tokens is not None and body.max_tokens > room):
        asked = body.max_tokens if body.max_tokens is not None else 0
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + asked} tokens ({num_prompt_tokens} in the prompt, "
            f"{asked} for the completion). Shorten the prompt or lower max_tokens.",
            "max_tokens",
        )
    return body.max_tokens if body.max_tokens is not None else min(default or room, room)


def sampling_params(
    body: GenerateRequest, max_tokens: int, default_backend: str, tools: ToolPlan | None = None
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


def response(
    out: GenerationOutput, request_id: str, model_name: str, chat: bool, tools: ToolPlan | None
) -> dict[str, Any]:
    """A whole answer: a completion, or a chat completion (its tool calls, if it made any)."""
    reason = finish_reason(out.finish_reason)
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


def chunk(request_id: str, model_name: str, chat: bool, content: Any, reason: str | None) -> dict[str, Any]:
    """One stream chunk: a chat delta (``content`` a dict) or a completion's text."""
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


def usage_chunk(out: GenerationOutput, request_id: str, model_name: str, chat: bool) -> dict[str, Any]:
    """A stream's last chunk with ``stream_options.include_usage``: no choices, the usage."""
    return {
        "id": request_id,
        "object": _object(chat, stream=True),
        "created": int(time.time()),
        "model": model_name,
        "choices": [],
        "usage": _usage(out),
    }


def stream_message(message: dict[str, Any]) -> dict[str, Any]:
    """A whole assistant message as a stream's delta (tool calls carry their index)."""
    if message.get("tool_calls") is None:
        return {"content": message["content"]}
    return {"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def error_event(e: Exception) -> str:
    """The last event of a stream that failed after it began."""
    if not isinstance(e, (RequestError, EngineDeadError)):
        logger.error("a stream failed", exc_info=e)
        message = f"internal server error ({type(e).__name__}); the details are in the server's log"
    else:
        message = engine_message(e)
    status = status_of(e)
    return event(
        {
            "error": {
                "message": message,
                "type": ERROR_TYPES.get(status, "APIError"),
                "param": None,
                "code": code_of(e) or status,
            }
        }
    )


def finish_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def served_by(out: GenerationOutput) -> dict[str, str] | None:
    """The response headers naming the grammar backend that enforced a guided request, and how
    many times it started again on the next one after a grammar failed mid-way (where it did);
    with data-parallel replicas, the replica that served it."""
    headers = {"X-Guidespec-Replica": out.replica} if out.replica else {}
    if out.grammar_backend:
        headers["X-Guidespec-Grammar-Backend"] = out.grammar_backend
        if out.stats.grammar_restarts:
            headers["X-Guidespec-Grammar-Restarts"] = str(out.stats.grammar_restarts)
    return headers or None


def _guided(body: GenerateRequest) -> GuidedDecoding | None:
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
    if role not in ROLES:
        raise APIError(400, f"messages[{index}].role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
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


def _prompt_shape(prompt: Any) -> str:
    """What a refused ``prompt`` is, in a few words: its type, or its first item that is not an int."""
    if not isinstance(prompt, list):
        return "null" if prompt is None else type(prompt).__name__
    if not prompt:
        return "an empty list"
    bad = next((t for t in prompt if type(t) is not int), prompt[0])
    text = json.dumps(bad)
    return f"a list holding {type(bad).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _object(chat: bool, stream: bool) -> str:
    if chat:
        return "chat.completion.chunk" if stream else "chat.completion"
    return "text_completion"


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
