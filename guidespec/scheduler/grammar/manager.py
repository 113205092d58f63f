"""Grammar ownership: the scheduler is the only place grammar state lives. ``GrammarManager`` is
what the scheduler's loop calls; it owns the matchers and fills the masks, and hands compiles to
``compiling.py`` (the compile queue and cache, which runs them in the compile process).

- A request waits UNREADY until its grammar is ready; ``poll`` hands back the ready and the
  failed ones.
- One matcher per guided request: filled in batches per backend (the backends' multi-threaded
  fills), advanced by exactly the accepted tokens, asked for forced tokens (jump-forward).
  Regex and choice rows whose grammars stand in the same state share one fill (``_fill_rows``).
- JSON requests that loop or near ``max_tokens`` are steered to close (``closing.py``).
- A matcher that stops without finishing (a backend's limit met mid-way) is never an end: a
  fill finds it, its rows allow only a stop token that is never used, and ``take_failures``
  hands it to the scheduler, which fails the request or starts it again on another backend
  (``alternatives``).
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Hashable, Sequence, TypeVar

import numpy as np

from guidespec.bitmask import bitmask_row, bitmask_width
from guidespec.grammar_backends import GrammarBackend, GrammarError, GrammarMatcher, create_backend
from guidespec.protocol import GuidedDecoding, backend_order
from guidespec.scheduler.grammar.closing_step import ClosingStep
from guidespec.scheduler.grammar.compile_process import CompileProcess
from guidespec.scheduler.grammar.compiling import Fallback, GrammarCompiler
from guidespec.scheduler.grammar.settings import FillRow, GrammarSettings

logger = logging.getLogger(__name__)
_Method = TypeVar("_Method", bound=Callable[..., Any])

# The kinds whose rows in one state share a fill (``GrammarMatcher.state_key``): a regex's or a
# choice's grammar has few states and many rows in each (``[0-9a-z ]+``: one state after the first
# token; xgrammar's fill of it costs ~15 µs a row, a copy of the row 0.3 µs). A JSON schema's
# nested rules seldom give a key; they are not asked.
_STATE_KINDS = frozenset({"regex", "choice"})
# a fill that shares checks one row it copied against that row's own fill, in each of its first
# _STATE_CHECKS fills that shared and one in _STATE_CHECK_EVERY after
_STATE_CHECKS, _STATE_CHECK_EVERY = 64, 256


def _settled(method: _Method) -> _Method:
    """A GrammarManager method that uses grammars: the draft steps' walk ends first."""

    @functools.wraps(method)
    def settled(self: GrammarManager, *args: Any, **kwargs: Any) -> Any:
        if self._walks:
            self.end_draft_walk()
        return method(self, *args, **kwargs)

    return settled  # type: ignore[return-value]


@dataclass
class _Walk:
    """Where a request's grammar is during a step's draft steps: the tokens sent so far, how many
    of them it accepted, and whether it refused one (then it stays before that token)."""

    tokens: list[int] = field(default_factory=list)
    accepted: int = 0
    refused: bool = False


class GrammarManager:
    """``compile_process``: one made by ``fork_compile_process`` (or ``start_compile_process``)
    with these settings; None starts one here."""

    def __init__(
        self, settings: GrammarSettings, tokenizer: Any, compile_process: CompileProcess | None = None
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.backends: dict[str, GrammarBackend] = {}
        # the compile process starts before the backends below: it imports meanwhile
        self.compiler = GrammarCompiler(settings, self._backend, self._create_matcher, compile_process)
        # deserializing needs a backend: the default one, and with "auto" the ones it falls back
        # to (llguidance's setup takes half a second), are made before the first step
        first, *others = backend_order(settings.default_backend)
        self._backend(first)
        for name in others:
            try:
                self._backend(name)
            except Exception as e:  # (not installed): a request that needs it reports why
                logger.warning("grammar backend %s is not available: %s", name, e)
        self.matchers: dict[str, tuple[str, GrammarMatcher]] = {}
        self._walks: dict[str, _Walk] = {}  # a step's draft steps (fill_after): request -> its walk
        self.refusals: dict[str, str] = {}  # request -> why a backend before the one serving it refused
        # request -> (guided, the backends "auto" has left after the one serving it, why the ones
        # before it refused): where it starts again if its grammar fails mid-way
        self.alternatives: dict[str, tuple[GuidedDecoding, list[str], list[str]]] = {}
        self.failures: dict[str, str] = {}  # request -> why its matcher failed (found by a fill)
        self._failable: set[str] = set()  # requests whose backend's matchers can fail (``matchers_fail``)
        # request -> the mask row ``end_token`` filled where its grammar stands now: the next
        # fill of that state copies it (cleared by every accept that moves the grammar on)
        self._filled: dict[str, np.ndarray] = {}
        self._by_state: set[str] = set()  # requests whose rows may share a fill (_STATE_KINDS)
        self.share_states = True  # off for good once a shared row differs from its own fill
        self._shared_fills = 0
        self.closing = ClosingStep(tokenizer, settings.vocab_size, settings.stop_token_ids)
        self.bitmask = np.zeros((settings.max_rows, bitmask_width(settings.vocab_size)), dtype=np.int32)
        self._stop_row = bitmask_row(settings.stop_token_ids, settings.vocab_size)
        self._end_row = bitmask_row(settings.stop_token_ids[:1], settings.vocab_size)  # (only the first)

    # ------------------------------------------------------------------ compile

    def submit(
        self,
        request_id: str,
        guided: GuidedDecoding,
        backends: list[str] | None = None,
        refusals: list[str] | None = None,
    ) -> bool:
        """Start (or join) the compile; True if the matcher is ready now. Raises GrammarError.
        With backend "auto", a backend that refuses the grammar (it cannot enforce it exactly)
        hands it to the next one; GrammarError says why each refused. ``backends`` (and why
        others refused or failed) where a request starts again on the ones left to it."""
        self.closing.track(request_id, guided)
        try:
            return self.compiler.submit(request_id, guided, backends, refusals)
        except GrammarError:
            self.closing.forget(request_id)
            raise

    def served(self, request_id: str) -> tuple[str, str]:
        """(the backend enforcing the request's grammar, why one before it refused or "")."""
        backend = self.matchers[request_id][0] if request_id in self.matchers else ""
        return backend, self.refusals.get(request_id, "")

    def poll(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Requests whose grammar became ready, and (request, error) for those that failed."""
        return self.compiler.poll()

    @property
    def has_pending(self) -> bool:
        return self.compiler.has_pending

    @_settled
    def release(self, request_id: str) -> None:
        self.compiler.release(request_id)
        self.refusals.pop(request_id, None)
        self.alternatives.pop(request_id, None)
        self.failures.pop(request_id, None)
        self._failable.discard(request_id)
        self.matchers.pop(request_id, None)
        self._filled.pop(request_id, None)
        self._by_state.discard(request_id)
        self.closing.forget(request_id)

    # ------------------------------------------------------------------ per step

    @_settled
    def fill(self, rows: list[FillRow], out: np.ndarray | None = None) -> np.ndarray:
        """One bitmask row per position to verify, request by request: a request with drafts
        ``d_1..d_k`` gets rows for its current state and after each ``d_j`` (its grammar is
        advanced through the drafts, filled at each depth, and rolled back). Fills are batched
        per backend and depth. Returns [sum(1 + len(drafts)), ceil(vocab / 32)]: the first rows
        of ``out`` where it has room (the mask arena's buffer: the rows are then written once),
        else of this manager's own buffer."""
        drafting = [i for i, r in enumerate(rows) if r.drafts]
        firsts: Sequence[int] = range(len(rows) + 1)  # each request's first row (one a request where none drafts)
        if drafting:
            firsts = list(itertools.accumulate((1 + len(r.drafts) for r in rows), initial=0))
        needed = firsts[-1]
        if out is None or out.shape[0] < needed or out.shape[1] != self.bitmask.shape[1]:
            return self._fill_rows_of(rows, firsts, drafting)
        own, self.bitmask = self.bitmask, out
        try:
            return self._fill_rows_of(rows, firsts, drafting)
        finally:
            self.bitmask = own

    def _fill_rows_of(self, rows: list[FillRow], firsts: Sequence[int], drafting: list[int]) -> np.ndarray:
        if firsts[-1] > self.bitmask.shape[0]:
            self.bitmask = np.zeros((firsts[-1], self.bitmask.shape[1]), dtype=np.int32)
        if self.closing.closers:
            self.closing.check_budgets(rows, self._grammar)
        if drafting:
            self._fill_drafts(rows, firsts, drafting)
        else:  # (a row a request: its grammar where it stands)
            self._fill_depth(rows, firsts, 0, range(len(rows)))
        failable = self._failable
        if failable:
            for i, r in enumerate(rows):  # a matcher that failed (at any depth: it stays failed) ends nothing
                reason = self._error(r.request_id) if r.request_id in failable else ""
                if reason:
                    self.failures[r.request_id] = reason
                    self.bitmask[firsts[i] : firsts[i + 1]] = self._stop_row  # (its token is never used)
        return self.bitmask[: firsts[-1]]

    def _fill_drafts(self, rows: list[FillRow], firsts: Sequence[int], drafting: list[int]) -> None:
        """The rows of a step where requests ``drafting`` have drafts: each grammar advanced
        through its drafts, filled at each depth, and rolled back."""
        saved = self.closing.snapshot([rows[i].request_id for i in drafting])
        depths = [len(r.drafts) for r in rows]  # how deep each request's grammar can follow its drafts
        accepted = [0] * len(rows)
        try:
            for depth in range(max(depths, default=0) + 1):
                active = [i for i in range(len(rows)) if depths[i] >= depth]
                # a drafting request's own row comes last, once its drafts are rolled back: the
                # last fill of its grammar is then where it stands (llguidance_backend.py: a
                # mask kept from a rolled-back state costs a fill to refresh otherwise)
                filled = [i for i in active if depth or not rows[i].drafts]
                self._fill_depth(rows, firsts, depth, filled)
                for i in active:
                    if depth == depths[i] or self.matchers[rows[i].request_id][1].is_terminated():
                        continue  # (a draft that ended the grammar: its rows after allow only a stop token)
                    if self._accept_draft(rows[i].request_id, rows[i].drafts[depth]):
                        accepted[i] += 1
                    else:  # an unchecked draft the grammar rejects: verification refuses it at this
                        depths[i] = depth  # row; the rows after it allow nothing (masks fail closed)
                        self.bitmask[firsts[i] + depth + 1 : firsts[i + 1]] = 0
        finally:
            for i, r in enumerate(rows):
                if accepted[i]:
                    self.matchers[r.request_id][1].rollback(accepted[i])
            self.closing.restore(saved)
        self._fill_depth(rows, firsts, 0, drafting)

    def _fill_depth(self, rows: list[FillRow], firsts: Sequence[int], depth: int, which: Sequence[int]) -> None:
        """The rows at ``depth`` of requests ``which`` (their grammars there): filled by their
        backends, a stop token where a draft ended the grammar, then narrowed by early closing."""
        matchers = self.matchers
        live: list[int] = []
        ended: list[int] = []
        for i in which:
            (ended if matchers[rows[i].request_id][1].is_terminated() else live).append(i)
        to_fill = live
        if depth == 0 and self._filled:  # (rows ``end_token`` filled at this state already)
            to_fill = []
            for i in live:
                row = self._filled.pop(rows[i].request_id, None)
                if row is None:
                    to_fill.append(i)
                else:
                    self.bitmask[firsts[i]] = row
        self._fill_rows([rows[i].request_id for i in to_fill], [firsts[i] + depth for i in to_fill])
        for i in ended:  # a draft ended the grammar: only a stop token may follow
            self.bitmask[firsts[i] + depth] = self._stop_row
        closers = self.closing.closers  # early closing, as its own step after the backend's fill
        tracked = [i for i in live if rows[i].request_id in closers] if closers else None
        if tracked:
            self.closing.restrict(
                self.bitmask,
                [
                    (rows[i].request_id, rows[i].output_len + depth, rows[i].max_tokens, firsts[i] + depth)
                    for i in tracked
                ],
                self._grammar,
            )

    def take_failures(self) -> list[tuple[str, str]]:
        """(request, why) for each request whose matcher a fill found failed since the last call."""
        failures = list(self.failures.items())
        self.failures.clear()
        return failures

    @_settled
    def prepare(self, request_id: str, max_tokens: int) -> None:
        """Work for the request's first mask that needs only its grammar (the first budget check's
        dry run of closing: ``ClosingStep.check_budgets``), done ahead of the step that needs it."""
        if request_id in self.matchers:
            self.closing.check_budgets([FillRow(request_id, (), 0, max_tokens)], self._grammar)

    def stop_rows(self, count: int) -> np.ndarray:
        """``count`` mask rows that allow only a stop token (a failed request's rows of a step)."""
        return np.repeat(self._stop_row[None], count, axis=0)

    def fill_after(self, request_ids: list[str], sequences: list[list[int]]) -> np.ndarray:
        """One mask row per request, for its state after ``sequences[i]`` (tokens past its final
        ones: a draft step's mask). A sequence the grammar refuses gets a row that allows nothing;
        one that ends the grammar allows only a stop token.

        A step's draft steps send each request its sequence so far, one token longer each time:
        the grammar stays where the last call left it and walks only the new tokens (a sequence
        that does not extend the last one starts again). ``end_draft_walk`` puts every grammar
        back as it was; every other method that uses a grammar does that first (``_settled``)."""
        if len(request_ids) > self.bitmask.shape[0]:
            self.bitmask = np.zeros((len(request_ids), self.bitmask.shape[1]), dtype=np.int32)
        live: list[int] = []
        for row, (request_id, sequence) in enumerate(zip(request_ids, sequences)):
            matcher = self.matchers[request_id][1]
            walked = self._walks.get(request_id)
            if walked is None or sequence[: len(walked.tokens)] != walked.tokens:
                if walked is not None:
                    matcher.rollback(walked.accepted)
                walked = self._walks[request_id] = _Walk()
            new = sequence[len(walked.tokens) :]
            if not walked.refused:  # (past a refused token every sequence is refused)
                count = matcher.advance(new)
                walked.accepted += count
                walked.refused = count < len(new)
            walked.tokens = list(sequence)
            if walked.refused:
                self.bitmask[row] = 0
            elif matcher.is_terminated():
                self.bitmask[row] = self._stop_row
            else:
                live.append(row)
        self._fill_rows([request_ids[row] for row in live], live)
        return self.bitmask[: len(request_ids)]

    def end_draft_walk(self) -> None:
        """Every grammar back where the step's draft steps found it (``fill_after``)."""
        if not self._walks:
            return
        for request_id, walked in self._walks.items():
            entry = self.matchers.get(request_id)
            if entry is not None and walked.accepted:
                entry[1].rollback(walked.accepted)
        self._walks.clear()

    @_settled
    def forced_tokens(self, request_id: str, limit: int) -> list[int]:
        """The tokens the grammar forces next (the matcher is left as it was)."""
        return self.matchers[request_id][1].forced_tokens(limit)

    @_settled
    def valid_prefix(self, request_id: str, prefix: list[int], tokens: Any) -> int:
        """How many of ``tokens`` the grammar accepts after ``prefix`` (the matcher is left as it was)."""
        matcher = self.matchers[request_id][1]
        accepted = 0
        for token in prefix:
            if not matcher.accept_token(token):
                matcher.rollback(accepted)
                return 0
            accepted += 1
        count = 0
        for token in tokens:
            if matcher.is_terminated() or not matcher.accept_token(int(token)):
                break
            count += 1
        matcher.rollback(accepted + count)
        return count

    @_settled
    def accept(self, request_id: str, token: int) -> bool:
        return self._accept(request_id, token) is not None

    @property
    def budget_tracked(self) -> Container[str]:
        """The requests whose rows early closing steers near their budget: ``advance_rows`` needs
        their budget and output length (the others' are unused)."""
        return self.closing.closers

    def advance(self, request_id: str, token: int, budget: int, produced: int) -> tuple[bool, bool]:
        """A sampled output token, in one call: ``accept`` it, then tell early closing
        ``produced`` output tokens of ``budget`` are written (this one counted). Returns
        (accepted, the grammar has terminated)."""
        (answer,) = self.advance_rows([(request_id, token, budget, produced)])
        if isinstance(answer, Exception):
            raise answer
        return answer

    def advance_rows(self, rows: Sequence[tuple[str, int, int, int]]) -> list[tuple[bool, bool] | Exception]:
        """``advance`` for a step's rows (request, token, budget, produced), the emit's: early
        closing hears every token first, its cycle detectors in one C call
        (``ClosingStep.add_many``), then each grammar accepts its own. A row whose grammar (or
        closer) raised gets the exception instead of its answer: the caller fails that request.
        A row's budget and output length are read only where early closing tracks its request
        (``budget_tracked``)."""
        if self._walks:  # (``_settled``, inline)
            self.end_draft_walk()
        filled, matchers, closing = self._filled, self.matchers, self.closing
        closers = closing.closers  # (none for a regex's or a choice's rows: their loop skips it)
        failed = closing.add_many([r[0] for r in rows], [r[1] for r in rows]) if closers else {}
        answers: list[tuple[bool, bool] | Exception] = []
        for request_id, token, budget, produced in rows:
            if request_id in failed:
                answers.append(failed[request_id])
                continue
            try:
                if filled:
                    filled.pop(request_id, None)
                matcher = matchers[request_id][1]
                if not matcher.accept_token(token):
                    answers.append((False, False))
                    continue
                if request_id in closers:
                    closing.near_budget(request_id, budget, produced)
                answers.append((True, matcher.is_terminated()))
            except Exception as e:
                answers.append(e)
        return answers

    def _accept(self, request_id: str, token: int) -> GrammarMatcher | None:
        """Advance the request's grammar by ``token`` (its matcher), or None where it refuses it."""
        self._filled.pop(request_id, None)
        self.closing.add(request_id, token)
        matcher = self.matchers[request_id][1]
        return matcher if matcher.accept_token(token) else None

    def closing_reason(self, request_id: str) -> str:
        return self.closing.reason(request_id)

    @_settled
    def accept_forced(self, request_id: str, limit: int) -> list[int]:
        """Accept and return the tokens the grammar forces next (jump-forward)."""
        matcher = self.matchers[request_id][1]
        forced = matcher.forced_tokens(limit)
        if forced:
            self._filled.pop(request_id, None)
        for i, token in enumerate(forced):
            if not matcher.accept_token(token):
                return forced[:i]
            self.closing.add(request_id, token)
        return forced

    def end_token(self, request_id: str) -> int | None:
        """``end_tokens`` for one request: its stop token if its output is complete, else None."""
        return self.end_tokens([request_id]).get(request_id)

    @_settled
    def end_tokens(self, request_ids: list[str], probes: list[int] | None = None) -> dict[str, int]:
        """The stop token of each request whose grammar allows it and nothing else now (its
        output is complete: it can end without a step). Checked first without a fill, so a
        grammar that cannot end here costs none: whether it takes the stop token (``can_end``),
        then a trial accept of ``probes[i]`` (a token that, accepted too, shows request i may go
        on: its last one, which a grammar that can end after it often takes again, as a pattern's
        ``[a-z]+`` or a number's digits).
        Those left are filled in one batch per backend, and the row of one that need not end is
        the next step's (``_fill_depth``): the check costs no fill more. Requests whose grammars
        stand in one state (``state_key``) take the first one's answer."""
        stops = self.settings.stop_token_ids
        if not stops:
            return {}
        candidates = []
        first_in: dict[Hashable, str] = {}  # a state key -> the request checked for it
        others: dict[str, list[str]] = {}  # that request -> the others in its state
        share = self.share_states and self._by_state
        for i, request_id in enumerate(request_ids):
            matcher = self.matchers[request_id][1]
            if matcher.is_terminated():
                continue
            key = matcher.state_key() if share and request_id in self._by_state else None
            if key is not None:
                first = first_in.setdefault(key, request_id)
                if first != request_id:
                    others.setdefault(first, []).append(request_id)
                    continue
            if not matcher.can_end(stops[0]):
                continue
            if probes is not None and probes[i] >= 0 and probes[i] not in stops and matcher.accept_token(probes[i]):
                matcher.rollback(1)
                continue
            candidates.append(request_id)
        if not candidates:
            return {}
        own = self.bitmask
        self.bitmask = np.zeros((len(candidates), own.shape[1]), dtype=np.int32)
        try:
            self._fill_rows(candidates, list(range(len(candidates))))
            rows = self.bitmask
        finally:
            self.bitmask = own
        ended = {}
        for request_id, row in zip(candidates, rows):
            if not np.array_equal(row, self._end_row):
                self._filled[request_id] = row  # (the others' rows: the next fill's, shared)
                continue
            ended[request_id] = stops[0]
            for other in others.get(request_id, ()):
                if self.matchers[other][1].can_end(stops[0]):  # (an end is never taken on trust)
                    ended[other] = stops[0]
        return ended

    @_settled
    def is_terminated(self, request_id: str) -> bool:
        return self.matchers[request_id][1].is_terminated()

    @_settled
    def error(self, request_id: str) -> str:
        """The backend's reason if the request's matcher failed (empty otherwise)."""
        return self._error(request_id)

    def _error(self, request_id: str) -> str:
        backend, matcher = self.matchers[request_id]
        reason = matcher.error()
        return f"{backend} gave up: {reason}" if reason else ""

    def build_closing_tokens(self) -> None:
        """What early closing needs of the vocabulary, made before the first step needs it
        (``ClosingStep.build_tokens``): the engine's start calls this while the workers load."""
        self.closing.build_tokens()

    def wait_started(self, timeout_s: float) -> bool:
        """Wait until the compile process has its backend ready (at the engine's start: its imports
        would otherwise share the cores with the first requests' forwards); False on timeout."""
        return self.compiler.wait_started(timeout_s)

    def shutdown(self) -> None:
        self.compiler.shutdown()

    # ------------------------------------------------------------------ helpers

    def _fill_rows(self, request_ids: list[str], out_rows: list[int]) -> None:
        """Fill ``self.bitmask[out_rows[i]]`` from each request's matcher, batched per backend;
        a row whose grammar stands where another's does (``state_key``) is that row, copied.
        ``out_rows`` ascend (every caller's do: a run of copies is then a slice)."""
        leaders: dict[Hashable, int] = {}
        copies: list[tuple[int, int, str]] = []  # (the row filled, a row in its state, that row's request)
        fills: list[tuple[str, int]] = []
        by_state, matchers = self._by_state, self.matchers
        share = self.share_states and by_state
        for request_id, out_row in zip(request_ids, out_rows):
            if share and request_id in by_state:
                key = matchers[request_id][1].state_key()
                if key is not None:
                    leader = leaders.setdefault(key, out_row)
                    if leader != out_row:
                        copies.append((leader, out_row, request_id))
                        continue
            fills.append((request_id, out_row))
        self._fill_each(fills)
        if copies:
            to: dict[int, list[int]] = {}
            for leader, row, _ in copies:
                to.setdefault(leader, []).append(row)
            for leader, rows in to.items():  # (a row broadcast: half a gather's time)
                if rows[-1] - rows[0] == len(rows) - 1:  # (a run of rows: a slice, half a list's 24 µs at 63)
                    self.bitmask[rows[0] : rows[-1] + 1] = self.bitmask[leader]
                else:
                    self.bitmask[rows] = self.bitmask[leader]
            self._check_shared(copies)

    def _fill_each(self, fills: list[tuple[str, int]], fresh: bool = False) -> None:
        """Each (request, row): the row filled from the request's matcher, batched per backend
        (``fresh``: none from a row the backend kept for a state)."""
        by_backend: dict[str, tuple[list[GrammarMatcher], list[int]]] = {}
        entries = self.matchers
        for request_id, out_row in fills:
            backend, matcher = entries[request_id]
            matchers, rows = by_backend.setdefault(backend, ([], []))
            matchers.append(matcher)
            rows.append(out_row)
        for backend, (matchers, rows) in by_backend.items():
            self.backends[backend].fill_bitmasks(matchers, self.bitmask, rows, fresh or not self.share_states)

    def _check_shared(self, copies: list[tuple[int, int, str]]) -> None:
        """Now and then, one copied row against its own fill (the keys rest on a backend's debug
        text, not on an API): where they differ, every copied row is filled and sharing stops."""
        self._shared_fills += 1
        n = self._shared_fills
        if n > _STATE_CHECKS and n % _STATE_CHECK_EVERY:
            return
        _, row, request_id = copies[n % len(copies)]
        copied = self.bitmask[row].copy()
        self._fill_each([(request_id, row)], fresh=True)
        if np.array_equal(copied, self.bitmask[row]):
            return
        backend = self.matchers[request_id][0]
        logger.error(
            "grammar backend %s: two rows with one state key had different masks; rows no longer share fills", backend
        )
        self.share_states = False
        self._fill_each([(request_id, row) for _, row, request_id in copies], fresh=True)

    @_settled
    def closing_length(self, request_id: str, limit: int) -> int | None:
        """How many tokens closing would take from here to the end of the document (with the stop
        token); None if more than ``limit``."""
        run, ended = self.closing_run(request_id, limit)
        return len(run) if ended or len(run) <= limit else None

    @_settled
    def closing_run(self, request_id: str, limit: int) -> tuple[list[int], bool]:
        """A dry run of closing from the grammar's state (``ClosingStep.dry_run``)."""
        return self.closing.dry_run(request_id, *self._grammar(request_id), limit)

    def _grammar(self, request_id: str) -> tuple[GrammarBackend, GrammarMatcher]:
        backend, matcher = self.matchers[request_id]
        return self.backends[backend], matcher

    def _accept_draft(self, request_id: str, token: int) -> bool:
        if not self.matchers[request_id][1].accept_token(token):
            return False
        self.closing.add(request_id, token)
        return True

    def _backend(self, name: str) -> GrammarBackend:
        if name not in self.backends:
            s = self.settings
            self.backends[name] = create_backend(name, self.tokenizer, s.vocab_size, s.stop_token_ids, s.fill_threads)
        return self.backends[name]

    def _create_matcher(self, request_id: str, backend: str, compiled: Any, fallback: Fallback) -> None:
        grammars = self._backend(backend)
        self.matchers[request_id] = (backend, grammars.create_matcher(compiled))
        if grammars.matchers_fail:
            self._failable.add(request_id)
        guided, backends, refusals = fallback
        if guided is not None and guided.kind in _STATE_KINDS:
            self._by_state.add(request_id)
        if refusals:
            self.refusals[request_id] = "; ".join(refusals)
        if guided is not None and backends:
            self.alternatives[request_id] = (guided, list(backends), list(refusals))
