"""Turning a request's new token into a RequestOutput delta: its token stops.

Stops, in order: EOS (unless ignore_eos), a stop token id, the grammar's end, max_tokens, the
model length. Text and stop strings are the client's (``guidespec.output_text``): the engine
sends token ids only, and a request the client ends at a stop string is aborted here.
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
    output = request.output_token_ids
    output.append(token)
    if (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids or grammar_done:
        return "stop"
    if len(output) >= params.max_tokens or len(request.prompt_token_ids) + len(output) >= max_model_len:
        return "length"
    return None


def process_new_token(
    request: Request, token: int, eos_token_ids: tuple[int, ...], max_model_len: int
) -> RequestOutput:
    return make_delta(request, append_token(request, token, eos_token_ids, max_model_len))


def make_delta(request: Request, reason: str | None) -> RequestOutput:
    """Every token not yet sent to the client, as one delta."""
    return _delta(request, reason)


def finish_output(request: Request, reason: str) -> RequestOutput:
    return _delta(request, reason)


def _delta(request: Request, reason: str | None) -> RequestOutput:
    new_tokens = request.output_token_ids[request.sent_token_count :]
    request.sent_token_count = len(request.output_token_ids)
    if reason is not None:
        request.finish_reason = reason
    restarted, request.restarted = request.restarted, False
    stats = request.stats
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_tokens,
        finished=reason is not None,
        finish_reason=reason,
        num_prompt_tokens=request.num_prompt_tokens,
        first_token_time=request.first_token_time,
        # (with the finishing delta, or each one where the client may end the request: a step's
        # message then carries no stats for every row)
        stats=None
        if reason is None and not request.params.stop
        else dataclasses.replace(stats, accepted_histogram=list(stats.accepted_histogram)),
        grammar_backend=request.grammar_backend,
        grammar_refusal=request.grammar_refusal,
        restarted=restarted,
    )
