"""A step's outputs into its requests, and their deltas to the client's outbox.

Each row's tokens advance its request (its grammar, its token stops); accepted drafts
advance its computed tokens; jump-forward appends the tokens the grammar forces ("unverified")
and a complete output's end token. The step's deltas leave in one ``RequestOutputs``. A row whose
request failed during the step, or whose token was sampled without its mask (``dropped``), is
skipped.
"""

from __future__ import annotations

import logging
import time
from itertools import accumulate


from guidespec.config import SchedulerConfig
from guidespec.protocol import BAD_REQUEST, NO_TOKEN, RequestOutput, StepOutputs
from guidespec.scheduler.batching import ScheduledRow
from guidespec.scheduler.grammar import GrammarManager
from guidespec.scheduler.output import append_token, make_delta
from guidespec.scheduler.request import FINISHED, Request
from guidespec.scheduler.speculation.proposer import Speculator
from guidespec.scheduler.step_channel import split
from guidespec.scheduler.table import RequestTable, output_budget

logger = logging.getLogger(__name__)


class Emitter:
    def __init__(
        self,
        cfg: SchedulerConfig,
        grammar: GrammarManager,
        speculator: Speculator | None,
        table: RequestTable,
    ) -> None:
        self.cfg = cfg
        self.grammar = grammar
        self.speculator = speculator
        self.table = table

    def emit(self, rows: list[ScheduledRow], outputs: StepOutputs, dropped: set[str]) -> int:
        """``dropped``: the requests whose token this step was sampled without its mask. A row
        run ahead of the step before on a token that step followed with more (jump-forward
        tokens, an end) has its sample dropped: its request's next step computes those. Returns
        how many tokens the step appended to its requests."""
        # (lists: NumPy's cumsum and a row's slice and tolist cost µs each on a step's few values)
        offsets = [0, *accumulate(outputs.num_tokens.tolist())]
        token_ids = outputs.token_ids.tolist()
        proposals = split(outputs.draft_tokens, outputs.num_draft_tokens)
        now = time.time()
        if self.speculator is not None:
            proposed = outputs.num_draft_tokens  # (a fused step times its draft steps apart too)
            timings = outputs.timings  # (forward start, forward end, mask ready, done)
            self.speculator.observe_step(
                sum(row.num_new_tokens for row in rows),
                outputs.forward_s,
                proposed.tolist() if proposed is not None else None,
                outputs.draft_s,
                float(timings[3] - timings[2]) if timings is not None and len(timings) == 4 else 0.0,
            )
        ending: list[Request] = []  # guided requests whose grammar may end here (``_end_complete``)
        # the deltas wait in the table's outbox (``RequestTable.send_outbox``): a step run ahead
        # has its bitmask filled and sent before them
        appended = self._emit_rows(
            rows, token_ids, offsets, proposals, now, self.table.outbox, dropped, outputs.step, ending
        )
        for row in rows:  # (a request failed since its grammar was advanced: its answer goes unused)
            row.request.advanced = None
        return appended

    def advance_grammars(self, rows: list[ScheduledRow], outputs: StepOutputs, dropped: set[str]) -> None:
        """The part of :meth:`emit` the next step's bitmask waits for, run before it: each guided
        row's grammar advanced by the first token the emit will append to it (the emit takes the
        answer, ``Request.advanced``, instead of asking again), so that the bitmask is filled and
        sent before the rest of the emit (stop checks, deltas) runs. One pass over
        the rows, its checks inline (as calls, 64 regex rows took ~0.16 ms of the scheduler's CPU
        a step), a budget only for the grammars early closing tracks."""
        guided = [i for i, row in enumerate(rows) if row.request.params.guided is not None]
        if not guided:
            return
        token_ids = outputs.token_ids.tolist()  # (as lists, once a step: a row's numpy slice and test cost ~5 µs)
        offsets = [0, *accumulate(outputs.num_tokens.tolist())]
        held, closes, max_model_len = self.table.requests, self.grammar.budget_tracked, self.cfg.max_model_len
        asked: list[tuple[Request, int]] = []
        asks: list[tuple[str, int, int, int]] = []
        for i in guided:  # (the rows ``_emit_row`` appends to: ``_emit_rows``'s checks)
            row = rows[i]
            request = row.request
            request_id = request.request_id
            if held.get(request_id) is not request or request_id in dropped or request.status is FINISHED:
                continue
            if row.num_logits and row.start + row.num_new_tokens - (row.num_logits - 1) != request.num_tokens:
                continue
            tokens = token_ids[offsets[i] : offsets[i + 1]]
            if not tokens or NO_TOKEN in tokens:  # (none appended: the emit fails it)
                continue
            token = tokens[0]
            asked.append((request, token))
            if request_id in closes:
                budget, produced = output_budget(request, max_model_len), len(request.output_token_ids) + 1
                asks.append((request_id, token, budget, produced))
            else:
                asks.append((request_id, token, 0, 0))
        if not asks:
            return
        for (request, token), answer in zip(asked, self.grammar.advance_rows(asks)):
            if isinstance(answer, Exception):
                self.table.fail_internal(request, "emitting its tokens", answer)
            else:
                request.advanced = (token, *answer)

    def _emit_rows(
        self,
        rows: list[ScheduledRow],
        token_ids: list[int],
        offsets: list[int],
        proposals: list[list[int]] | None,
        now: float,
        deltas: list[RequestOutput],
        dropped: set[str],
        step: int,
        ending: list[Request],
    ) -> int:
        """Each row's tokens appended to its request (``_emit_row``); returns how many were."""
        appended = 0
        held = self.table.requests  # (``RequestTable.holds``, inline)
        for i, row in enumerate(rows):
            request = row.request
            if held.get(request.request_id) is not request:  # failed during this step
                continue
            if request.request_id in dropped:  # sampled without its mask: that token runs again
                request.advance_computed(-row.num_logits)
                request.mask_came_late = True
                continue
            if request.pending_step == step:
                request.pending_step = -1
            known = request.num_tokens
            if row.num_logits and row.start + row.num_new_tokens - (row.num_logits - 1) != known:
                continue  # run ahead on a token that the step before followed with more (jump-forward)
            new_tokens = token_ids[offsets[i] : offsets[i + 1]]
            if NO_TOKEN in new_tokens:
                self.table.fail(
                    request,
                    "the grammar allows no token of the model's vocabulary here (it asks for "
                    "text the tokenizer cannot produce)",
                    BAD_REQUEST,
                )
                continue
            try:
                self._emit_row(row, new_tokens, proposals[i] if proposals is not None else None, now, deltas, ending)
            except Exception as e:
                self.table.fail_internal(request, "emitting its tokens", e)
            appended += request.num_tokens - known
        self._end_complete(ending, deltas)
        return appended

    def _end_complete(self, ending: list[Request], deltas: list[RequestOutput]) -> None:
        """The guided requests whose grammar could end here: those whose output is complete (the
        grammar allows only the stop token) end now, without a step (one batched fill for all);
        then each one's delta."""
        ends: dict[str, int] = {}
        try:
            if ending:
                probes = [request.output_token_ids[-1] if request.output_token_ids else -1 for request in ending]
                ends = self.grammar.end_tokens([request.request_id for request in ending], probes)
        except Exception:
            logger.exception("the end check of %d guided requests failed; they go on", len(ending))
        for request in ending:
            try:
                end = ends.get(request.request_id)
                reason = self._append(request, end) if end is not None else None
                self._deliver(request, reason, deltas)
            except Exception as e:
                self.table.fail_internal(request, "emitting its tokens", e)

    def _emit_row(
        self,
        row: ScheduledRow,
        new_tokens: list[int],
        proposal: list[int] | None,
        now: float,
        deltas: list[RequestOutput],
        ending: list[Request],
    ) -> None:
        """Append one row's tokens to its request (its grammar, its token stops), then
        add the request's delta to the step's (or, where its grammar may end here, to ``ending``
        for the end check first: ``_end_complete``)."""
        request = row.request
        num_drafts = row.num_logits - 1 if row.num_logits else 0
        accepted = max(0, len(new_tokens) - 1)  # (the row's other tokens count as computed since it went out)
        if self.speculator is not None:
            self.speculator.observe(request, num_drafts, accepted)
        if not new_tokens or request.finished:
            return
        request.stats.record_step(num_drafts, accepted)
        if not request.output_token_ids:
            request.first_token_time = now
        known = request.num_tokens
        if len(new_tokens) == 1:  # (a decode row's one token)
            reason, appended = self._append(request, new_tokens[0]), 1
        else:
            reason, appended = self._append_all(request, new_tokens)
        # accepted drafts are in the KV cache now; rejected drafts' entries get overwritten later
        if accepted and appended:
            request.advance_computed(min(accepted, appended))
        if proposal is not None and self.speculator is not None and appended == len(new_tokens):
            self.speculator.store_proposals(request, proposal)
        guided = request.guided
        if reason is None and guided and self.cfg.jump_forward == "unverified" and not self._speculates(request):
            reason = self._jump_forward(request)
        if request.pending_step >= 0 and request.num_tokens != known + len(new_tokens):
            request.pending_step = -1  # the next step ran ahead on this row's token alone: its sample is dropped
        if reason is None and guided and self.cfg.jump_forward != "off":
            ending.append(request)  # (a complete output ends here, not in a step)
            return
        if reason is None and not request.sends_each_step:  # (``_deliver``'s first test, without the call)
            return
        self._deliver(request, reason, deltas)

    def _deliver(self, request: Request, reason: str | None, deltas: list[RequestOutput]) -> None:
        """The request's delta into the step's (a request that does not stream: only its last).
        A request that ends leaves the table: the next step's row for it, if it ran ahead, is
        skipped."""
        if reason == "error" or (reason is None and not request.sends_each_step):  # (the finished output comes whole)
            return
        delta = make_delta(request, reason)
        deltas.append(delta)
        if delta.finished:
            self.table.forget(request)

    def _speculates(self, request: Request) -> bool:
        return self.speculator is not None and self.speculator.speculates(request)

    def _append_all(self, request: Request, tokens: list[int]) -> tuple[str | None, int]:
        """Append a step's tokens until one finishes the request: (finish reason, tokens appended)."""
        for count, token in enumerate(tokens, start=1):
            reason = self._append(request, token)
            if reason is not None:
                return reason, count
        return None, len(tokens)

    def _append(self, request: Request, token: int) -> str | None:
        """Advance the request (and its grammar) by one token; the finish reason, if any."""
        grammar_done = False
        if request.guided:
            advanced, request.advanced = request.advanced, None
            if advanced is not None and advanced[0] == token:  # asked before the bitmask: advance_grammars
                accepted, grammar_done = advanced[1], advanced[2]
            else:
                budget = output_budget(request, self.cfg.max_model_len)
                accepted, grammar_done = self.grammar.advance(
                    request.request_id, token, budget, len(request.output_token_ids) + 1
                )
            if not accepted:
                failure = self.grammar.error(request.request_id)
                if failure:
                    self.table.grammar_failed(request, failure)
                else:
                    self.table.fail(request, f"internal error: the grammar rejected sampled token {token}")
                return "error"
        return append_token(request, token, self.cfg.eos_token_ids, self.cfg.max_model_len, grammar_done)

    def _jump_forward(self, request: Request) -> str | None:
        """Append the tokens the grammar forces; the next step computes them with no sampling."""
        limit = output_budget(request, self.cfg.max_model_len) - len(request.output_token_ids)
        forced = self.grammar.accept_forced(request.request_id, limit)
        terminated = bool(forced) and self.grammar.is_terminated(request.request_id)
        for i, token in enumerate(forced):
            last = i == len(forced) - 1
            reason = append_token(request, token, self.cfg.eos_token_ids, self.cfg.max_model_len, last and terminated)
            if reason is not None:
                return reason
        return None
