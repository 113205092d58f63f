"""Early closing as its own step of a fill: after a grammar backend has filled a request's mask
row, ``ClosingStep.restrict`` narrows it where the request is closing (``closing.py`` says how a
row is narrowed and when a request starts closing).

This module holds each guided JSON request's ``EarlyCloser`` and everything that needs the
request's grammar as well: the budget check before a step's fill (a dry run of closing from the
grammar's state), the restriction of a filled row, and the dry run itself. It is handed the
request's backend and matcher for each call and never changes the matcher's state: every trial
accept is rolled back. It does not fill rows and does not own matchers (``manager.py`` does).
"""

from __future__ import annotations

import array
import json
from collections import OrderedDict
from typing import Any, Callable, Sequence

import numpy as np

from guidespec.grammar_backends import GrammarBackend, GrammarMatcher
from guidespec.grammar_backends.tables import tokenizer_tables
from guidespec.bitmask import allowed_ids, bitmask_row
from guidespec.protocol import GuidedDecoding
from guidespec.model_files import text_encoder
from guidespec.scheduler.grammar.closing import MAX_STEPS, ClosingTokens, EarlyCloser
from guidespec.scheduler.grammar.narrowing import ASK, forces_nothing, library, narrow_rows
from guidespec.scheduler.grammar.settings import FillRow

MAX_CLOSING_RUN = 2048  # the longest dry run of closing (``dry_run``)
# the grammar fills a dry run's lookahead may cost; past them it goes on without one (a lexer-heavy
# grammar's fill costs ~1 ms, and a lookahead row up to 64 of them: 4 s a dry run without a bound)
MAX_DRY_RUN_FILLS = 512
_SCRIPT_MARGIN = 8  # a dry run of closing this near the budget's end is written as it is
_SHARED_RUN_TOKENS = 16  # dry runs from outputs this short are shared between requests (``_budget_dry_run``)
_SHARED_RUNS = 256


class ClosingStep:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.encode = text_encoder(tokenizer)
        self.vocab_size, self.stop_token_ids = vocab_size, stop_token_ids
        self.closers: dict[str, EarlyCloser] = {}
        self._stop_row = bitmask_row(stop_token_ids, vocab_size)
        self._tokens: ClosingTokens | None = None  # built by build_tokens, or at first use
        # the budget checks' dry runs from a grammar's first states, shared by the requests with
        # that grammar (a batch of requests with one schema checks its budget once)
        self._early_runs: OrderedDict[tuple[Any, ...], tuple[list[int], bool]] = OrderedDict()

    # ------------------------------------------------------------------ request state

    def track(self, request_id: str, guided: GuidedDecoding) -> None:
        """Start tracking a JSON request (unless it switched closing off)."""
        if guided.close_early and guided.kind in ("json_schema", "json_object"):
            self.closers[request_id] = EarlyCloser(_schema_reader(guided), (guided.kind, guided.json_schema))

    def forget(self, request_id: str) -> None:
        self.closers.pop(request_id, None)

    def add(self, request_id: str, token: int) -> None:
        """A token the request's grammar accepted."""
        closer = self.closers.get(request_id)
        if closer is not None:
            closer.add(token)

    def add_many(self, request_ids: Sequence[str], tokens: Sequence[int]) -> dict[str, Exception]:
        """``add`` for a step's rows (a token each), their native cycle detectors in one C call
        (a call a row cost ~1 µs of ctypes each); returns the requests whose closer raised."""
        closers = self.closers
        pairs = [(r, closer, t) for r, t in zip(request_ids, tokens) if (closer := closers.get(r)) is not None]
        failed: dict[str, Exception] = {}
        lib = library()
        n = len(pairs)
        addresses = array.array("q", [closer.detector.address for _, closer, _ in pairs])
        if lib is not None and n > 1 and all(addresses):
            given = array.array("i", [t for _, _, t in pairs])  # (held through the call, as each array here)
            periods = array.array("i", bytes(4 * n))
            lib.repeats_add_many(addresses.buffer_info()[0], given.buffer_info()[0], n, periods.buffer_info()[0])
            for (request_id, closer, token), period in zip(pairs, periods):
                closer.detector.period = period
                try:
                    closer.added(token, period > 0)
                except Exception as e:
                    failed[request_id] = e
            return failed
        for request_id, closer, token in pairs:
            try:
                closer.add(token)
            except Exception as e:
                failed[request_id] = e
        return failed

    def snapshot(self, request_ids: Sequence[str]) -> dict[str, tuple[Any, ...]]:
        return {r: closer.snapshot() for r in request_ids if (closer := self.closers.get(r))}

    def restore(self, saved: dict[str, tuple[Any, ...]]) -> None:
        for request_id, state in saved.items():
            self.closers[request_id].restore(state)

    def near_budget(self, request_id: str, budget: int, produced: int) -> None:
        """The request has ``produced`` of its ``budget`` output tokens: a JSON output close to
        the end starts closing."""
        closer = self.closers.get(request_id)
        if closer is not None and not closer.closing and budget - produced <= closer.reserve(budget):
            closer.near_budget()

    def reason(self, request_id: str) -> str:
        closer = self.closers.get(request_id)
        return closer.reason if closer is not None else ""

    # ------------------------------------------------------------------ per fill

    def check_budgets(
        self, rows: Sequence[FillRow], grammar_of: Callable[[str], tuple[GrammarBackend, GrammarMatcher]]
    ) -> None:
        """The budget check (``_check_budget``) of each of a fill's rows whose check is due: most
        are not; a request's first, at output length 0, is."""
        closers = self.closers
        for r in rows:
            closer = closers.get(r.request_id)
            if closer is not None and not closer.script and r.output_len >= closer.next_check:
                self._check_budget(r.request_id, closer, r.output_len, r.max_tokens, grammar_of)

    def _check_budget(
        self,
        request_id: str,
        closer: EarlyCloser,
        output_len: int,
        max_tokens: int,
        grammar_of: Callable[[str], tuple[GrammarBackend, GrammarMatcher]],
    ) -> None:
        """Start closing a JSON output once a dry run of its closing (``dry_run``), and half as
        many tokens again, and 16 for the model's own choices, no longer fits in what is left of
        its budget; once the dry run alone just fits, write the dry run itself. Checked at the
        first mask and again as what is left nears what is needed: more often the nearer it gets,
        so a long output costs a few dry runs. Where closing cannot fit at all, it is checked
        again at doubling intervals, with a dry run only where the output is inside a string, and
        rows outside strings are narrowed without the grammar's lookahead meanwhile
        (``EarlyCloser.hopeless``)."""
        backend, matcher = grammar_of(request_id)
        remaining = max_tokens - output_len
        if closer.hopeless and not closer.in_string(self._closing_tokens()):
            # outside a string each value the model writes takes the tokens the closing would
            # (required names are the grammar's own): the gap stays, and no dry run is made
            closer.recheck *= 2
            closer.next_check = output_len + closer.recheck
            return
        run, ended = self._budget_dry_run(request_id, closer, backend, matcher, min(remaining, MAX_CLOSING_RUN))
        length = len(run)
        if ended and length + _SCRIPT_MARGIN >= remaining:
            closer.near_budget(script=run)  # no room left for the model's choices
            return
        if not ended and length >= remaining:  # no way to close within the budget: do what can be done
            closer.near_budget()
            # checked again 32, 64, 128 ... tokens on (what the model writes inside a string can
            # bring the end within reach: one long token for a pattern's many characters)
            closer.recheck = 2 * closer.recheck if closer.hopeless else 32
            closer.next_check, closer.hopeless = output_len + closer.recheck, True
            return
        closer.hopeless = False
        need = length + length // 2 + 16
        if need >= remaining:
            closer.near_budget()
        if closer.closing:
            closer.next_check = output_len + max(1, (remaining - length - _SCRIPT_MARGIN) // 2)
        else:
            closer.next_check = output_len + max(8, (remaining - need) // 2)

    def _budget_dry_run(
        self, request_id: str, closer: EarlyCloser, backend: GrammarBackend, matcher: GrammarMatcher, limit: int
    ) -> tuple[list[int], bool]:
        """``dry_run``, shared by requests whose grammar and output so far are the same (the state
        of the grammar, and of closing, follows from them): a request's first check, mostly."""
        if len(closer.tokens) > _SHARED_RUN_TOKENS:
            return self.dry_run(request_id, backend, matcher, limit)
        key = (id(backend), closer.grammar, tuple(closer.tokens), limit)
        found = self._early_runs.get(key)
        if found is None:
            found = self._early_runs[key] = self.dry_run(request_id, backend, matcher, limit)
            if len(self._early_runs) > _SHARED_RUNS:
                self._early_runs.popitem(last=False)
        else:
            self._early_runs.move_to_end(key)
        return list(found[0]), found[1]

    def restrict(
        self,
        bitmask: np.ndarray,
        rows: Sequence[tuple[str, int, int, int]],
        grammar_of: Callable[[str], tuple[GrammarBackend, GrammarMatcher]],
    ) -> None:
        """Narrow filled rows of ``bitmask`` where their request is closing, or this near its
        budget's end: steer a JSON output that loops or nears ``max_tokens`` to close. ``rows``:
        (request, output index the row is the mask for, max_tokens, row of ``bitmask``) of tracked
        requests; ``grammar_of``: a request's backend and matcher. The rows of the common case,
        closing outside a string where the end is out of reach (no lookahead), are narrowed all
        at once; the others one by one."""
        closing = self._closing_tokens()
        closers = self.closers
        at_once: list[tuple[str, int, EarlyCloser]] = []
        one_by_one: list[tuple[str, int, EarlyCloser]] = []
        for request_id, index, max_tokens, at in rows:
            closer = closers[request_id]
            if not (closer.closing or (index >= 1 and max_tokens - index <= closer.reserve(max_tokens))):
                continue
            if closer.script and closer.follow_script(bitmask[at]):
                continue
            # (while the end is out of reach, outside a string: no lookahead, whose trial fills
            # would buy nothing; inside one it still steers to an example of its pattern)
            if closer.hopeless and not closer.in_string(closing):
                at_once.append((request_id, at, closer))
            else:
                one_by_one.append((request_id, at, closer))
        # a row where the grammar writes the next tokens itself (a name) stays as it is: narrowing
        # would only split them. The grammar is asked (its jump-forward string: 1-3 µs) only where
        # the narrowing would change the row and the row leaves it open: one allowing two
        # one-character tokens forces nothing
        if at_once:  # EarlyCloser.restrict without a view, for all of them at once
            ats = [at for _, at, _ in at_once]
            banned = [closer.banned_words() if closer.banned else None for _, _, closer in at_once]
            status = narrow_rows(bitmask, ats, closing.tiers_outside, banned, closing.probe)
            if ASK in status:
                free = [
                    i
                    for i, told in enumerate(status)
                    if told == ASK and not grammar_of(at_once[i][0])[1].forced_tokens(1)
                ]
                narrow_rows(bitmask, [ats[i] for i in free], closing.tiers_outside, [banned[i] for i in free])
        if one_by_one:
            surely = forces_nothing(bitmask, np.array([at for _, at, _ in one_by_one]), closing.probe)
            for (request_id, at, closer), surely_free in zip(one_by_one, surely):
                backend, matcher = grammar_of(request_id)
                if not surely_free and matcher.forced_tokens(1):
                    continue
                row = bitmask[at]
                closer.restrict(row, closing, _GrammarView(backend, matcher, row, self.encode))

    def dry_run(
        self, request_id: str, backend: GrammarBackend, matcher: GrammarMatcher, limit: int
    ) -> tuple[list[int], bool]:
        """A dry run of closing from the grammar's state, the grammar alone choosing: forced
        tokens, then in each row closing narrowed the token of the longest text, else the lowest
        id allowed (a one-character token). Returns its tokens (ending with the stop token) and
        whether they end the document: False if more than ``limit`` were needed (``limit + 1``
        tokens returned) or where the dry run cannot go on (a forced token that does not replay:
        the length is a lower bound). Past ``MAX_DRY_RUN_FILLS`` trial fills, rows are narrowed
        without the grammar's view (no lookahead). Everything is rolled back."""
        closer = self.closers[request_id]
        closing = self._closing_tokens()
        saved = closer.snapshot()
        row = np.zeros((1, self._stop_row.shape[0]), dtype=np.int32)
        run: list[int] = []
        fills = 0  # the lookahead's, bounded by MAX_DRY_RUN_FILLS
        closer.closing = True
        try:
            while len(run) <= limit:
                if matcher.is_terminated():
                    return run, True
                forced = matcher.forced_tokens(limit + 1 - len(run))
                if forced:
                    for token in forced:
                        if not matcher.accept_token(token):
                            return run, False
                        run.append(token)
                        closer.add(token)
                    continue
                backend.fill_bitmasks([matcher], row, [0])
                stops = allowed_ids(row[0] & self._stop_row)
                if len(stops):
                    return run + [int(stops[0])], True
                view = _GrammarView(backend, matcher, row[0], self.encode) if fills < MAX_DRY_RUN_FILLS else None
                narrowed = closer.restrict(row[0], closing, view)
                fills += view.fills if view is not None else 0
                allowed = allowed_ids(row[0], limit=MAX_STEPS)  # the first is taken, or the longest of these
                if not len(allowed):
                    return run, False
                if narrowed:  # the longest of the narrowed tokens (the first of them on a tie)
                    token = int(allowed[np.argmax(closing.piece_length[allowed])])
                else:
                    token = int(allowed[0])
                if not matcher.accept_token(token):
                    return run, False
                run.append(token)
                closer.add(token)
            return run, False
        finally:
            matcher.rollback(len(run))
            closer.restore(saved)

    def build_tokens(self) -> None:
        """Sort the vocabulary into closing's classes now (``ClosingTokens``: a pass over every
        token's piece, 0.3 s at 49k tokens and 3 s at Gemma 3's 262k on a loaded 2-core host),
        and build closing's C library (0.3 s where it is not cached), not in the step of the first
        request that closes."""
        self._closing_tokens()
        library()

    def _closing_tokens(self) -> ClosingTokens:
        if self._tokens is None:
            self._tokens = closing_tokens(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self._tokens


def closing_tokens(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], keep: bool = False) -> ClosingTokens:
    """The vocabulary's closing classes (``ClosingTokens.from_tokenizer``): the ones kept for this
    tokenizer, else made (and kept with ``keep``: the zygote's, for the schedulers it forks after,
    beside the backends' tables, ``tables.py``)."""
    stops = tuple(stop_token_ids)
    make = lambda: ClosingTokens.from_tokenizer(tokenizer, vocab_size, stops)  # noqa: E731
    return tokenizer_tables("closing", tokenizer, vocab_size, stops, make, keep)  # type: ignore[no-any-return]


class _GrammarView:
    """Closing's view of one request's grammar at one mask row: trial accepts, always rolled back."""

    def __init__(
        self, backend: GrammarBackend, matcher: GrammarMatcher, current: np.ndarray, encode: Callable[[str], list[int]]
    ) -> None:
        # ``current`` is the row itself: closing narrows it only after asking (no copy needed)
        self.backend, self.matcher, self.current, self.encode = backend, matcher, current, encode
        self.scratch = np.zeros((1, current.shape[0]), dtype=np.int32)
        self._accepted = False  # whether the last trial's tokens were all accepted
        self.fills = 0  # the trial fills made

    def lookahead(self, candidates: Sequence[int], target: np.ndarray) -> tuple[list[int], list[int]]:
        reaching: list[int] = []
        moving: list[int] = []
        for token in candidates:
            if self._after([token], target):
                reaching.append(token)
            elif self._accepted and not np.array_equal(self.scratch[0], self.current):
                moving.append(token)
        return reaching, moving

    def completion(self, texts: Sequence[str], target: np.ndarray) -> list[int]:
        for text in texts:
            tokens = self.encode(text)
            if tokens and self._after(tokens, target):
                return tokens
        return []

    def _after(self, tokens: list[int], target: np.ndarray) -> bool:
        """Whether the grammar accepts ``tokens`` and then allows a token of ``target`` (its mask
        left in ``self.scratch``); the matcher is rolled back."""
        accepted = 0
        try:
            for token in tokens:
                if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                    break
                accepted += 1
            self._accepted = accepted == len(tokens)
            if not self._accepted:
                return False
            self.backend.fill_bitmasks([self.matcher], self.scratch, [0])
            self.fills += 1
            return bool((self.scratch[0] & target).any())
        finally:
            self.matcher.rollback(accepted)


def _schema_reader(guided: GuidedDecoding) -> Callable[[], Any] | None:
    """The request's JSON schema, parsed when closing first needs it (None for any JSON object)."""
    if guided.kind != "json_schema":
        return None
    return lambda: json.loads(guided.json_schema) if isinstance(guided.json_schema, str) else guided.json_schema
