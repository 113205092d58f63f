"""Requests coming in: validation, admission to the table and the queue, their grammars' compiles.

A ``GenerateRequest`` is validated again (the client's ``validate_request``: nothing the engine
cannot serve enters), its grammar goes to the compile process, and it joins the queue; one whose
grammar still compiles waits there (its prompt may be prefilled meanwhile) until ``take_compiled``
promotes it. An abort ends a request wherever it is, also between its grammar's failure and its
new start (``RequestTable.restarts``).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from guidespec.config import SchedulerConfig
from guidespec.grammar_backends import GrammarError
from guidespec.ipc.zmq_channel import Channel
from guidespec.protocol import (
    BAD_REQUEST,
    GRAMMAR_FAILED,
    INTERNAL_ERROR,
    GenerateRequest,
    InvalidRequest,
    RequestOutput,
    validate_request,
)
from guidespec.scheduler.batching import Batcher
from guidespec.scheduler.grammar import GrammarManager
from guidespec.scheduler.output import finish_output
from guidespec.scheduler.request import Request
from guidespec.scheduler.table import RequestTable, Restart, error_output, output_budget

logger = logging.getLogger(__name__)


class Intake:
    def __init__(
        self,
        cfg: SchedulerConfig,
        batcher: Batcher,
        grammar: GrammarManager,
        table: RequestTable,
        client_out: Channel,
    ) -> None:
        self.cfg = cfg
        self.batcher = batcher
        self.grammar = grammar
        self.table = table
        self.client_out = client_out
        self._failed_compiles: list[tuple[str, str]] = []  # (request, error) seen while a step ran

    def add(self, message: GenerateRequest) -> None:
        """Take in a request; a bug met doing so fails it alone."""
        try:
            self._add_request(message)
        except Exception:
            logger.exception("request %s could not be added", message.request_id)
            self.table.forget_id(message.request_id)
            self.client_out.send(
                RequestOutput(
                    message.request_id,
                    [],
                    True,
                    "error",
                    "internal error while adding the request",
                    error_status=INTERNAL_ERROR,
                )
            )

    def abort(self, request_id: str) -> None:
        request = self.table.requests.get(request_id)
        if request is not None:
            self.client_out.send(finish_output(request, "abort"))
            self.table.forget(request)
        restarting = [r for r in self.table.restarts if r.request.request_id == request_id]
        for restart in restarting:  # (between its grammar's failure and its new start)
            self.table.restarts.remove(restart)
            self.client_out.send(finish_output(restart.request, "abort"))

    def poll_grammars(self) -> None:
        """Move requests whose grammar compiled to the front of the queue; fail those that did not
        (also those whose compile failed while a step ran); start again those whose grammar
        failed during the last step."""
        self.take_compiled()
        failed, self._failed_compiles = self._failed_compiles, []
        for request_id, error in failed:
            if request_id in self.table.requests:
                self.table.fail(self.table.requests[request_id], error, BAD_REQUEST)
        restarts, self.table.restarts = self.table.restarts, []
        for restart in restarts:
            self._start_again(restart)

    def take_compiled(self) -> None:
        """Ready the requests whose grammar compiled (the step's collection calls it too: a compile
        that ends while the workers compute a step, as a prompt's prefill, is loaded and checked
        meanwhile, not after the step); failures wait for ``poll_grammars``, between steps."""
        ready, failed = self.grammar.poll()
        self._failed_compiles.extend(failed)
        for request_id in ready:
            request = self.table.requests[request_id]
            request.grammar_backend, request.grammar_refusal = self.grammar.served(request_id)
            self.batcher.promote(request)
            self._prepare_grammar(request)

    def _prepare_grammar(self, request: Request) -> None:
        """The grammar's work for the request's first mask that needs no step (the first dry run
        of closing), done as soon as its matcher exists rather than in the first step's fill."""
        try:
            self.grammar.prepare(request.request_id, output_budget(request, self.cfg.max_model_len))
        except Exception:  # the first fill does it again and fails the request there if it must
            logger.exception("request %s: preparing its grammar failed", request.request_id)

    def _add_request(self, message: GenerateRequest) -> None:
        prompt = message.prompt_token_ids.tolist() if isinstance(message.prompt_token_ids, np.ndarray) else []
        error = self._validate(message, prompt)
        if error is not None:
            self.client_out.send(RequestOutput(message.request_id, [], True, "error", error, error_status=BAD_REQUEST))
            return
        request = Request(
            message.request_id,
            prompt,
            message.params,
            message.arrival_time,
            stream=message.stream,
        )
        if message.params.guided is not None:
            try:
                request.compiling_since = time.monotonic()
                request.grammar_ready = self.grammar.submit(request.request_id, message.params.guided)
                if request.grammar_ready:
                    request.grammar_backend, request.grammar_refusal = self.grammar.served(request.request_id)
            except GrammarError as e:
                self.client_out.send(
                    RequestOutput(message.request_id, [], True, "error", str(e), error_status=BAD_REQUEST)
                )
                return
        self.table.add(request)

    def _validate(self, message: GenerateRequest, prompt: list[int]) -> str | None:
        """The client validated the request already (the same ``validate_request``): this is the
        engine's own guard, for a client that did not."""
        if message.request_id in self.table.requests:
            return f"request id {message.request_id!r} is already in use"
        try:
            validate_request(prompt, message.params, self.cfg.vocab_size, self.cfg.max_model_len)
        except InvalidRequest as e:
            return str(e)
        return None

    def _start_again(self, restart: Restart) -> None:
        """A request whose grammar failed, from its prompt on the next backend
        (``RequestTable.grammar_failed``)."""
        old = restart.request
        request = Request(
            old.request_id,
            old.prompt_token_ids,
            old.params,
            old.arrival_time,
            stream=old.stream,
            restarted=True,  # (the client drops what it was sent: a request with stop strings gets each step's)
        )
        request.stats.grammar_restarts = old.stats.grammar_restarts + 1
        try:
            request.compiling_since = time.monotonic()
            request.grammar_ready = self.grammar.submit(
                request.request_id, restart.guided, restart.backends, restart.refusals
            )
        except GrammarError as e:
            self.client_out.send(
                error_output(
                    request, f"the grammar stopped before the output was complete: {e}", INTERNAL_ERROR, GRAMMAR_FAILED
                )
            )
            return
        if request.grammar_ready:
            request.grammar_backend, request.grammar_refusal = self.grammar.served(request.request_id)
        self.table.add(request)
