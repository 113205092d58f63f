"""Turning a request's new token into a RequestOutput delta: stop conditions and text.

Stops, in order: EOS (unless ignore_eos), a stop token id, a stop string (the text is cut
before it), the grammar's end, max_tokens, the model length. While a request runs, text that could be the start
of a stop string is held back, so a streamed client never sees part of a stop string.
"""

from __future__ import annotations

import dataclasses

from guidespec.protocol import RequestOutput
from guidespec.scheduler.request import Request


def append_token(
    request: Request, token: int, eos_token_ids: tuple[int, ...], max_model_len: int, grammar_done: bool = False
) -> str | None:
    """Add one output token; return the finish reason it causes, if any."""
    params = request.params
    request.output_token_ids.append(token)
    if (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
        return "stop"
    request.output_text += request.detokenizer.add(token)
    if (params.stop and _cut_at_stop_string(request)) or grammar_done:
        return "stop"
    if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= max_model_len:
        return "length"
    return None


def process_new_token(
    request: Request, token: int, eos_token_ids: tuple[int, ...], max_model_len: int
) -> RequestOutput:
    return make_delta(request, append_token(request, token, eos_token_ids, max_model_len))


def make_delta(request: Request, reason: str | None) -> RequestOutput:
    """Everything not yet sent to the client, as one delta."""
    return _delta(request, reason)


def finish_output(request: Request, reason: str) -> RequestOutput:
    return _delta(request, reason)


def _cut_at_stop_string(request: Request) -> bool:
    text = request.output_text
    longest = max(len(s) for s in request.params.stop)
    search_from = max(0, request.sent_text_len - longest)
    hits = [i for i in (text.find(s, search_from) for s in request.params.stop) if i >= 0]
    if not hits:
        return False
    request.output_text = text[: min(hits)]
    return True


def _delta(request: Request, reason: str | None) -> RequestOutput:
    text = request.output_text
    end = len(text)
    if reason is None and request.params.stop:
        end = max(request.sent_text_len, end - (max(len(s) for s in request.params.stop) - 1))
    new_text = text[request.sent_text_len : end]
    new_tokens = request.output_token_ids[request.sent_token_count :]
    request.sent_text_len, request.sent_token_count = end, len(request.output_token_ids)
    if reason is not None:
        request.finish_reason = reason
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_tokens,
        new_text=new_text,
        finished=reason is not None,
        finish_reason=reason,
        num_prompt_tokens=request.num_prompt_tokens,
        first_token_time=request.first_token_time,
        # (with the finishing delta alone: a step's message then carries no stats for every row)
        stats=None
        if reason is None
        else dataclasses.replace(request.stats, accepted_histogram=list(request.stats.accepted_histogram)),
        grammar_backend=request.grammar_backend,
        grammar_refusal=request.grammar_refusal,
    )
