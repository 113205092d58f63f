"""The request table: every request the scheduler holds, and how one leaves it.

A request is in ``RequestTable.requests`` from its admission (``intake.py``) until it finishes,
is aborted or fails; leaving frees its slot, its grammar and its drafter's state. Failures
that concern one request end that request alone, with a one-line message and a status saying
whose fault it is; the traceback goes to this process's log. A grammar that stops before its
output is complete (a backend's limit met mid-way) fails its request with ``GRAMMAR_FAILED``,
or queues it to start again on the next backend of "auto" (``restarts``, taken by the intake
between steps) while none of its output has reached the client.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from guidespec.ipc.zmq_channel import Channel
from guidespec.protocol import (
    ENGINE_UNAVAILABLE,
    GRAMMAR_FAILED,
    INTERNAL_ERROR,
    EngineDead,
    GuidedDecoding,
    RequestOutput,
    RequestOutputs,
)
from guidespec.scheduler.batching import Batcher
from guidespec.scheduler.grammar import GrammarManager
from guidespec.scheduler.output import finish_output
from guidespec.scheduler.request import Request
from guidespec.scheduler.speculation.proposer import Speculator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restart:
    """A request whose grammar failed mid-way, to start again on the backends left to it."""

    request: Request
    guided: GuidedDecoding
    backends: list[str]
    refusals: list[str]


class RequestTable:
    def __init__(
        self, batcher: Batcher, grammar: GrammarManager, speculator: Speculator | None, client_out: Channel
    ) -> None:
        self.batcher = batcher
        self.grammar = grammar
        self.speculator = speculator
        self.client_out = client_out
        self.requests: dict[str, Request] = {}
        self.restarts: list[Restart] = []  # requests whose grammar failed, to start again after the step
        self.outbox: list[RequestOutput] = []  # deltas emitted, not yet sent (``send_outbox``)

    def send_outbox(self) -> None:
        """The deltas emitted since the last call, in one message (one send, not one per request).
        Anything else to the client goes after them: a request's error never overtakes its tokens."""
        if self.outbox:
            deltas, self.outbox = self.outbox, []
            self.client_out.send(RequestOutputs(deltas))

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.batcher.add(request)

    def holds(self, request: Request) -> bool:
        """Whether ``request`` is still in the table (not failed or finished during this step)."""
        return self.requests.get(request.request_id) is request

    def forget(self, request: Request) -> None:
        self.batcher.remove(request)
        self.grammar.release(request.request_id)
        if self.speculator is not None:
            self.speculator.release(request.request_id)
        self.requests.pop(request.request_id, None)

    def forget_id(self, request_id: str) -> None:
        """``forget`` for a request that may be half added."""
        request = self.requests.get(request_id)
        if request is not None:
            self.forget(request)
        else:
            self.grammar.release(request_id)

    def fail(self, request: Request, error: str, status: int = INTERNAL_ERROR, code: str = "") -> None:
        """End one request with an error; the others carry on."""
        self.send_outbox()
        self.client_out.send(error_output(request, error, status, code))
        self.forget(request)

    def fail_internal(self, request: Request, doing: str, e: Exception) -> None:
        """A bug met while serving one request: its traceback to the log, a one-line 500 to it."""
        logger.exception("request %s failed while %s", request.request_id, doing)
        self.fail(request, f"internal error while {doing}: {type(e).__name__}", INTERNAL_ERROR)

    def grammar_failed(self, request: Request, reason: str) -> None:
        """The request's grammar stopped before its output was complete (``reason`` names the
        backend and why): never an end. With backend "auto" and another backend left, a request
        none of whose output has reached the client (it does not stream, or nothing went out
        yet) starts again on that backend, after this step; any other fails with
        ``GRAMMAR_FAILED``. The rest of the batch is not touched."""
        guided, backends, refusals = self.grammar.alternatives.get(request.request_id, (None, [], []))
        sent = request.stream and request.sent_token_count > 0  # (a request with stop strings sends each step's: void)
        logger.warning(
            "request %s: its grammar failed after %d tokens (%s)%s",
            request.request_id,
            len(request.output_token_ids),
            reason,
            f"; it starts again on {backends[0]}" if guided is not None and backends and not sent else "",
        )
        if guided is None or not backends or sent:
            self.fail(
                request,
                f"the grammar stopped before the output was complete ({reason}); no valid answer was produced",
                INTERNAL_ERROR,
                GRAMMAR_FAILED,
            )
            return
        self.forget(request)  # (its rows of this step are dropped: ``Emitter._emit_rows``)
        self.restarts.append(Restart(request, guided, backends, [*refusals, reason]))

    def fail_all(self, reason: str) -> None:
        """The engine is dead: every request ends with ``reason``, then the client is told."""
        logger.error("engine failed: %s", reason)
        self.send_outbox()
        for request in list(self.requests.values()):
            self.client_out.send(error_output(request, reason, ENGINE_UNAVAILABLE))
        self.requests.clear()
        self.client_out.send(EngineDead(reason))
        time.sleep(0.1)  # let the frames leave


def output_budget(request: Request, max_model_len: int) -> int:
    """Output tokens the request can have: max_tokens, or less where the model length ends first
    (a JSON output then starts closing in time, as it does before max_tokens)."""
    return min(request.params.max_tokens, max_model_len - request.num_prompt_tokens)


def error_output(request: Request, error: str, status: int, code: str = "") -> RequestOutput:
    """The request's last delta, ending it with ``error``."""
    output = finish_output(request, "error")
    return RequestOutput(
        output.request_id,
        output.new_token_ids,
        True,
        "error",
        error,
        output.num_prompt_tokens,
        error_status=status,
        error_code=code,
    )
