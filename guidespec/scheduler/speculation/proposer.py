"""The scheduler's side of speculation: which requests draft, how many tokens, and which.

Each step, for every row of a speculating request that ends at its last known token (a decode
row, or the prompt's last chunk: the prefill step verifies drafts too, the grammar's forced
opening and prompt lookup's guess at what follows, except with a model drafter, which proposes
after a decode step):

1. the draft length: ``max_draft_len`` (the request's or the engine's), or with ``adaptive``
   the length that maximises expected tokens per second for the whole batch — a request's
   acceptance rate ``a`` (running average) makes its ``j``-th draft worth ``a**j`` tokens, and
   the step's cost is modelled as ``c0 + c1 * tokens`` from measured forward times (plus, for a
   draft model or EAGLE head on rank 0, its measured proposing time: ``d0`` per draft step, one
   forward of the draft model, and ``d1`` per draft token; measured on one row before the draft
   model drafts for a whole batch). Drafts are
   added greedily while they raise tokens per second, so at a large batch where the forward is
   compute-bound speculation turns itself down instead of turning into a loss; a new request's
   rate starts from the drafter's mean over every request so far; a request whose
   drafts keep failing still probes one draft every 8 steps (a model drafter's: every 32
   steps, all such requests in the same step, since each probe first catches the draft model up;
   after two fruitless probes in a row a model drafter stops probing for that request, which
   then never runs the draft model again). A model drafter runs only where the plan expects
   tokens per second to rise by at least 10% (near break-even the estimates' error makes it a
   loss as often as a gain), proposes nothing for a request before a decode plan has judged it
   (no drafts at its prefill step), and where even drafts of acceptance 0.9 for every row would
   not clear that bar at the current batch, nothing probes. Rows the draft model does not draft
   for (all of them where it does not pay, as at a large batch) draft by prompt lookup instead
   (``ngram_fallback``, on by default), planned as an n-gram drafter's are, with acceptance
   figures of its own;
2. the drafts: the grammar's forced tokens first (guided requests; up to ``MAX_FORCED_DRAFTS``,
   not counted in the draft length: they are certain, and jump-forward gives requests that do
   not speculate all of them), then the drafter's tokens, cut at the first one the grammar
   rejects; a guided row given no drafter tokens still drafts its forced tokens;
3. the row becomes ``1 + k`` tokens with ``1 + k`` logits rows, verified by the workers
   (``worker/verify.py``).

Requests with repetition/frequency/presence penalties do not speculate (the workers' penalty
state would have to follow the drafts).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import traceback
from typing import Any

import numpy as np

from guidespec import envs
from guidespec.config import SpeculativeConfig
from guidespec.scheduler.batching import ScheduledRow
from guidespec.scheduler.request import Request
from guidespec.scheduler.speculation.drafters import Drafter, ModelDrafter, create_drafter
from guidespec.scheduler.speculation.gate import DraftGate
from guidespec.scheduler.speculation.ngram import NGramDrafter, ngram_drafter

_PROBE_EVERY = 8
# a model drafter's probes are rarer and all at once: a probing row first runs the tokens it held
# back (lazy following), one draft-model forward for every probing row together
_MODEL_PROBE_EVERY = 32
# a request whose model-drafter probes failed this many times in a row (the plan never took
# drafting up again) stops probing: every probe first runs the draft model over all the tokens
# held back since the last one, which at a large batch cost more than the probes ever gave back
_MODEL_PROBES_BEFORE_OFF = 2
_OPTIMISTIC_RATE = 0.9  # the acceptance a probe could at best reveal
# a model drafter drafts only where the plan expects tokens per second to rise by this much
_MODEL_MARGIN = 0.1
_PRIOR_RATE = 0.7  # a new request's acceptance before its drafter has been seen at work
MAX_FORCED_DRAFTS = 16
# Jump-forward alone (method "forced"): with async scheduling, a step with guided rows lets the
# next one run ahead of its outputs while forced drafts are rare. A step planned ahead cannot draft
# a row's forced tokens (they follow the token still being sampled): such a row takes a step per
# forced token instead. Stepping in turn costs the scheduler's planning and emitting outside the
# forward, ``h`` of the rest of a step: forced drafts pay above ``h`` of them per row a step (a
# quarter or more of a batch-64 step of the tiny model on 2 cores; 2-3% of the default model's).
_FORCED_WEIGHT = 0.05  # of a step's forced drafts in their running mean (``forced_rate``)
_AHEAD_CHECKS = 16  # guided rows a step run ahead looks at for forced positions (in turn)
# The draft gate's bound (``observe_emitted``) is rank 0's time fit by tokens, at a token a row:
# taken only where one of the last _BOUND_STEPS steps had at most _BOUND_REACH times that many
# tokens. A fit over drafting steps alone, 64 rows of ~200-250 tokens, once put 64 tokens at 7.5
# ms (rank 0 took ~2.7 in steps without drafts: forward 1.0, picks 1.7): drafting at 12k
# tokens/s then beat its 8.5k bound and was never tried against 17-21k without drafts.
_BOUND_STEPS, _BOUND_REACH = 64, 1.5


@dataclasses.dataclass
class _Acceptance:
    rate: float = _PRIOR_RATE  # running mean of accepted / drafted, per draft token
    steps_without_drafts: int = 0
    planned: int | None = None  # the draft length the adaptive plan gave it last
    probes: int = 0  # probes since the plan last drafted for it
    off: bool = False  # a model drafter's probes kept failing: no more (its forced drafts go on)


class CostModel:
    """Forward time of a step as ``c0 + c1 * tokens``: a least-squares fit over recent steps
    (exponentially weighted), with a prior until steps of different sizes have been seen."""

    def __init__(self, decay: float = 0.98, prior_ratio: float = 0.05) -> None:
        self.decay = decay
        self.prior_ratio = prior_ratio
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.sw = d * self.sw + 1
        self.sx = d * self.sx + tokens
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + tokens * tokens
        self.sxy = d * self.sxy + tokens * seconds

    def coefficients(self) -> tuple[float, float]:
        """(c0, c1) with c0 > 0 and c1 >= 0."""
        if self.sw < 1:
            return 1.0, self.prior_ratio
        mean_x, mean_y = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mean_x * mean_x
        if var < 0.25:  # every step had the same size: only the prior slope
            c1 = self.prior_ratio * mean_y / (1 + self.prior_ratio * mean_x)
        else:
            c1 = max(0.0, (self.sxy / self.sw - mean_x * mean_y) / var)
        c0 = max(1e-6, mean_y - c1 * mean_x)
        return c0, c1


class DraftCost:
    """Rank 0's proposing time as ``d0 * draft_steps + d1 * draft_tokens``: each draft step is one
    forward of the draft model over the rows still drafting, so a draft token costs more in a
    small batch than in a large one. Least squares without intercept, exponentially weighted;
    until steps with several rows have been seen, all of it is put on ``d0`` (the cautious side)."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.sss = self.ssd = self.sdd = self.sys = self.syd = 0.0  # sums of s*s, s*d, d*d, y*s, y*d
        self.seen = False

    def observe(self, steps: int, drafts: int, seconds: float) -> None:
        k = self.decay
        self.sss = k * self.sss + steps * steps
        self.ssd = k * self.ssd + steps * drafts
        self.sdd = k * self.sdd + drafts * drafts
        self.sys = k * self.sys + seconds * steps
        self.syd = k * self.syd + seconds * drafts
        self.seen = True

    def coefficients(self) -> tuple[float, float]:
        """(d0, d1) >= 0: seconds per draft step and per draft token; (0, 0) before any."""
        if not self.seen:
            return 0.0, 0.0
        det = self.sss * self.sdd - self.ssd * self.ssd
        if det > 1e-9 * self.sss * self.sdd:
            d0 = (self.sys * self.sdd - self.syd * self.ssd) / det
            d1 = (self.syd * self.sss - self.sys * self.ssd) / det
            if d0 >= 0 and d1 >= 0:
                return d0, d1
        return max(0.0, self.sys / self.sss), 0.0


class Speculator:
    def __init__(
        self,
        cfg: SpeculativeConfig,
        grammar: Any,
        max_model_len: int,
        tokenizer: Any = None,
        vocab_size: int | None = None,
        jump_forward: bool = False,
    ) -> None:
        self.cfg = cfg
        # verified jump-forward: a guided request that does not speculate still drafts its
        # grammar's forced tokens (its mask allows nothing else, so they are always accepted)
        self.jump_forward = jump_forward and cfg.use_forced_tokens
        self.grammar = grammar
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size  # drafts outside [0, vocab_size) fail their request
        self._failures: list[tuple[Request, str, str]] = []  # (request, message, traceback) of failed drafters
        self.drafter: Drafter = create_drafter(cfg, tokenizer)
        self.acceptance: dict[str, _Acceptance] = {}
        # a model drafter's fallback: prompt lookup, for the rows the draft model does not draft for
        # (with the adaptive length), with acceptance figures of its own
        self.lookup: NGramDrafter | None = None
        if isinstance(self.drafter, ModelDrafter) and cfg.adaptive and cfg.ngram_fallback:
            self.lookup = self.drafter.ngram or ngram_drafter(cfg, tokenizer)
        self.lookup_acceptance: dict[str, _Acceptance] = {}
        self.lookup_prior = _PRIOR_RATE
        self._lookup_drafted: set[str] = set()  # requests whose drafts this step are prompt lookup's
        # what this drafter's drafts have been worth over every request so far: a new request
        # starts from it (a drafter that keeps failing is not tried in full on each newcomer)
        self.prior = _PRIOR_RATE
        self.cost = CostModel()
        self.draft_cost = DraftCost()  # rank 0's proposing time (model drafters)
        self._plans = 0  # plans made so far: a model drafter's probes fall on multiples of _MODEL_PROBE_EVERY
        # whether, at the batch the last plan near a probe saw, drafts of an optimistic acceptance
        # would clear the model drafter's bar: where not (a compute-bound batch), nothing probes
        self._model_drafting_pays = True
        self._num_forced: dict[str, int] = {}  # request -> how many of its drafts this step are forced tokens
        # forced drafts per guided decode row a step, lately (a running mean: ``may_run_ahead``);
        # from 1 whenever no guided request runs, so that a first JSON document's keys are drafted
        # while its rate is learnt (and a request's steps do not depend on the ones before it)
        self.forced_rate = 1.0
        self._guided: set[str] = set()  # the guided requests planned and not yet released
        self._checked = 0  # rows looked at by ``observe_ahead`` so far: where the next look starts
        # whether a drafter's drafts pay for the whole step, measured (``gate.py``): not a model
        # drafter's, whose proposing cost the plan models (``DraftCost``) and clears by a margin
        self.gate: DraftGate | None = None
        setting = envs.draft_gate()
        if cfg.adaptive and cfg.method in ("ngram", "user") and setting != "off":
            self.gate = DraftGate(open=setting == "open")
        # whether the last plan was its drafter's: a row of it speculates, and the gate is open
        self.drafted = True
        self.busy = CostModel()  # rank 0's forward, masking and sampling (not its waits) by tokens
        self._busy_tokens: collections.deque[int] = collections.deque(maxlen=_BOUND_STEPS)  # the last steps' tokens

    def speculates(self, request: Request) -> bool:
        params = request.params
        return params.speculative and params.max_draft_len != 0 and not params.has_penalties

    def plan(self, rows: list[ScheduledRow], max_tokens_per_step: int) -> list[ScheduledRow]:
        """The rows again, decoding rows of speculating requests extended by their drafts."""
        self._plans += 1
        budget = max_tokens_per_step - sum(row.num_new_tokens for row in rows)
        limits: dict[int, int] = {}  # row -> the most drafter tokens it may get
        rooms: dict[int, int] = {}  # row -> the most drafts of any kind (max_tokens, model length)
        forced_only: dict[int, int] = {}  # row -> room: guided rows that do not speculate (jump-forward)
        model = isinstance(self.drafter, ModelDrafter)
        drafting = self.gate is None or self.gate.drafting
        self.drafted = False
        for i, row in enumerate(rows):
            request = row.request
            speculates = None  # (asked once a row needs it: most rows of a step run ahead need not)
            if not self.drafted:  # whether a row speculates (one run ahead too: the next step's would draft)
                speculates = self.drafted = drafting and self.speculates(request)
            # a row that ends at its last known token drafts: a decode row, or the prompt's last
            # chunk (its drafts verified in the prefill step; not with a model drafter, whose
            # proposals come from a decode step, nor while the request's grammar still compiles)
            if not (
                request.grammar_ready
                and row.num_logits == 1
                and row.start + row.num_new_tokens == request.num_tokens
                and (request.output_token_ids or not model)
            ):
                continue
            if speculates is None:
                speculates = drafting and self.speculates(request)
            if not (speculates or (self.jump_forward and request.guided)):  # (the others get no drafts)
                continue
            room = min(
                request.params.max_tokens - len(request.output_token_ids) - 1,
                self.max_model_len - request.num_tokens,
                _kv_room(request, request.num_tokens),  # (drafts are written where its blocks are)
            )
            if not speculates:
                if self.jump_forward and request.guided and not request.params.has_penalties and room > 0:
                    forced_only[i] = room
                continue
            cap = min(request.params.max_draft_len or self.cfg.max_draft_len, room)
            if cap > 0:
                limits[i], rooms[i] = cap, room
        out = list(rows)
        decoding = forced_total = 0  # guided decode rows and their forced drafts: ``forced_rate``
        lengths: dict[int, int] = {}  # row -> drafter tokens
        from_lookup: set[int] = set()
        if limits and budget > 0:
            lengths, from_lookup = self._lengths(rows, limits, budget)
            budget -= sum(lengths.values())
        for i, room in forced_only.items():  # jump-forward alone: forced tokens, no drafter's
            lengths[i], rooms[i] = 0, room
        for i, k in lengths.items():
            request = rows[i].request
            # the grammar's forced tokens are certain: drafted even where the drafter's are not
            # worth it now (what jump-forward gives requests that do not speculate)
            forced: list[int] = []
            drafter = self.drafter
            if i in from_lookup and self.lookup is not None:
                drafter = self.lookup
                self._lookup_drafted.add(request.request_id)
                self.store_proposals(request, [])  # nothing of the draft model's is due for it this step
            try:
                if request.guided and self.cfg.use_forced_tokens and k + budget > 0:
                    forced = self.grammar.forced_tokens(
                        request.request_id, min(rooms[i], MAX_FORCED_DRAFTS, k + budget)
                    )
                drafts = self._propose(request, drafter, forced, min(k, rooms[i] - len(forced))) if k > 0 else forced
            except Exception as e:  # a drafter's (or its grammar's) fault fails its request alone (take_failures)
                self._failures.append((request, f"{type(e).__name__}: {str(e)[:200]}", traceback.format_exc()))
                forced, drafts = [], []
            budget -= len(drafts) - k
            self._num_forced[request.request_id] = len(forced)
            if request.guided:
                self._guided.add(request.request_id)
                if request.output_token_ids:
                    decoding, forced_total = decoding + 1, forced_total + len(forced)
            request.draft_tokens = drafts
            if drafts:
                out[i] = ScheduledRow(request, rows[i].start, rows[i].num_new_tokens + len(drafts), 1 + len(drafts))
        if decoding:
            self._observe_forced(forced_total / decoding)
        return out

    def may_run_ahead(self, rows: list[ScheduledRow], host_share: float) -> bool:
        """Whether, with async scheduling, the step after ``rows``' may be planned before their
        outputs: with jump-forward the only drafts (method ``forced``), where no row is guided or
        the guided rows' forced drafts a row a step have lately been fewer than ``host_share``
        (the scheduler's time outside the workers over the rest, in steps run in turn: what
        running ahead saves a step). A drafter's drafts follow every token: its steps run one
        after another, except an n-gram (or user) drafter's where its last plan had no request to
        draft for (its gate closed: ``gate.py``; none that speculates)."""
        if self.cfg.method != "forced" and (self.gate is None or self.drafted):
            return False
        return self.forced_rate < host_share or not any(row.request.guided for row in rows)

    def observe_ahead(self, rows: list[ScheduledRow]) -> None:
        """``rows`` were planned ahead of the step before's outputs, which have now been emitted:
        up to ``_AHEAD_CHECKS`` of their guided decode rows (in turn over the steps) are asked
        whether their grammar now forces tokens, which a plan after those outputs would have
        drafted. ``f`` of a step's rows at such a position is ``f / (1 - f)`` forced drafts a row a
        step had the steps gone in turn (the forced tokens would have shared the others' steps)."""
        if not self.jump_forward or not rows:
            return
        # the rows from where the last step's look stopped, round to it, until enough are asked
        # (a step's 64 rows filtered whole cost more than the asks)
        start, count, forced, looked = self._checked % len(rows), 0, 0, 0
        while looked < len(rows) and count < _AHEAD_CHECKS:
            row = rows[(start + looked) % len(rows)]
            looked += 1
            request = row.request
            if (
                row.num_logits != 1
                or not request.guided
                or not request.output_token_ids
                or request.finished
                or not request.grammar_ready
            ):
                continue
            try:
                forced += bool(self.grammar.forced_tokens(request.request_id, 1))
                count += 1
            except Exception:  # (a request whose grammar failed meanwhile: its failure is the emit's)
                pass
        self._checked += looked
        if count > 0:
            share = forced / count
            self._observe_forced(share / max(1.0 - share, 0.1))

    def _observe_forced(self, rate: float) -> None:
        # a long memory: a JSON document's names come in bursts, and a mean that forgets between
        # them runs ahead in each gap only to step once more for each name's first token (the
        # default model's JSON cases at 1 request: 5% fewer tokens a second with a weight of 0.5)
        self.forced_rate += _FORCED_WEIGHT * (rate - self.forced_rate)

    def take_failures(self) -> list[tuple[Request, str, str]]:
        """Requests whose drafter raised during the last ``plan``: (request, message, traceback)."""
        failures, self._failures = self._failures, []
        return failures

    def proposal_lengths(self, rows: list[ScheduledRow]) -> tuple[np.ndarray, np.ndarray] | None:
        """With a draft model: how many drafts rank 0 should propose after this step, per row, and
        how many of each row's draft steps its grammar masks (from the first)."""
        if not isinstance(self.drafter, ModelDrafter):
            return None
        lengths = np.zeros(len(rows), dtype=np.int32)
        masked = np.zeros(len(rows), dtype=np.int32)
        for i, row in enumerate(rows):
            request = row.request
            if row.num_logits and self.speculates(request):
                lengths[i] = max(
                    0,
                    min(
                        self._proposal_cap(request),
                        request.params.max_tokens - len(request.output_token_ids) - 2,
                        _kv_room(request, row.start + row.num_new_tokens + 1),
                    ),
                )
                if request.guided and self.cfg.constrain_drafts:
                    steps = self.cfg.draft_mask_steps
                    masked[i] = lengths[i] if steps is None else min(int(lengths[i]), steps)
        return lengths, masked

    def _proposal_cap(self, request: Request) -> int:
        """Drafts worth proposing: the cap, or with the adaptive length one more than last planned
        (so the plan can grow by one a step, and a probe always finds a draft)."""
        cap = request.params.max_draft_len or self.cfg.max_draft_len
        stats = self.acceptance.get(request.request_id)
        if not self.cfg.adaptive:
            return cap
        if stats is None or stats.planned is None:  # no decode plan has judged it yet (its prefill step)
            return 0
        if stats.planned == 0:  # not drafting: propose only for the coming probe (the next plan's)
            probe_next = (self._plans + 1) % _MODEL_PROBE_EVERY == 0
            return 1 if not stats.off and self._model_drafting_pays and probe_next else 0
        return min(cap, stats.planned + 1)

    def store_proposals(self, request: Request, tokens: list[int]) -> None:
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.store(request.request_id, tokens)

    def observe(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """After verification: update the request's acceptance rate and its figures."""
        request.draft_tokens = []
        forced = self._num_forced.pop(request.request_id, 0)  # forced drafts say nothing of the drafter
        lookup = request.request_id in self._lookup_drafted
        if lookup:
            self._lookup_drafted.discard(request.request_id)
        if num_drafts <= forced:
            return
        observed = max(0, num_accepted - forced) / (num_drafts - forced)
        if lookup:
            stats = self.lookup_acceptance.setdefault(request.request_id, _Acceptance(self.lookup_prior))
            self.lookup_prior = 0.9 * self.lookup_prior + 0.1 * observed
        else:
            stats = self.acceptance.setdefault(request.request_id, _Acceptance(self.prior))
            self.prior = 0.9 * self.prior + 0.1 * observed
        stats.rate = 0.7 * stats.rate + 0.3 * observed

    def observe_emitted(self, drafted: bool, rows: list[ScheduledRow], tokens: int, times: tuple[float, float]) -> None:
        """A step planned with its drafter's drafts or without (``drafted``), whose rows gave
        ``tokens``; ``times``: when it was planned and when its emit ended (``time.time()``): the
        draft gate's measure."""
        if self.gate is not None:
            prompts = [row for row in rows if row.start < len(row.request.prompt_token_ids)]
            prompt, decoding = sum(row.num_new_tokens for row in prompts), len(rows) - len(prompts)
            ceiling = self.plain_bound(decoding)
            self.gate.observe(drafted, tokens, len(rows), times, prompt * self.cost.coefficients()[1], ceiling)

    def plain_bound(self, rows: int) -> float:
        """The most tokens a second steps without drafts could give ``rows`` decoding rows: a token
        a row in rank 0's time for them (its forward, masking and sampling, fit by tokens), where
        a recent step had about that few tokens (``_BOUND_REACH``); else none (inf)."""
        if not rows or not self._busy_tokens or min(self._busy_tokens) > _BOUND_REACH * rows:
            return math.inf
        c0, c1 = self.busy.coefficients()
        return rows / (c0 + c1 * rows)

    def observe_step(
        self,
        num_tokens: int,
        forward_s: float,
        proposed: list[int] | None = None,
        draft_s: float = 0.0,
        sample_s: float = 0.0,
    ) -> None:
        """A step's forward time for its token count, and what rank 0's drafter spent proposing
        ``proposed[b]`` drafts for each row; ``sample_s``: rank 0's masking and sampling after the
        forward (the draft gate's bound: ``observe_emitted``)."""
        self.cost.observe(num_tokens, forward_s)
        if self.gate is not None:
            self.busy.observe(num_tokens, forward_s + sample_s)
            self._busy_tokens.append(num_tokens)
        if proposed and max(proposed) > 0:
            self.draft_cost.observe(max(proposed), sum(proposed), draft_s)

    def release(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
        self.lookup_acceptance.pop(request_id, None)
        self._num_forced.pop(request_id, None)
        self._lookup_drafted.discard(request_id)
        if request_id in self._guided:
            self._guided.discard(request_id)
            if not self._guided:
                self.forced_rate = 1.0
        self.drafter.release(request_id)
        if self.lookup is not None:
            self.lookup.release(request_id)

    # ------------------------------------------------------------------ helpers

    def _lengths(
        self, rows: list[ScheduledRow], limits: dict[int, int], budget: int
    ) -> tuple[dict[int, int], set[int]]:
        """Draft lengths per row, and the rows whose drafts prompt lookup makes (the fallback)."""
        if not self.cfg.adaptive:
            out: dict[int, int] = {}
            for i, cap in limits.items():
                out[i] = min(cap, budget)
                budget -= out[i]
            return out, set()
        c0, c1 = self.cost.coefficients()
        # drafts are judged against a step of the decode rows alone: a prefill chunk in the step is
        # work done whatever is drafted, and counting its time made drafts look cheap beside it
        # (an int8 draft model drafted for 16 rows in steps of 200-500 tokens, mostly prefill, and lost)
        decode = [row for row in rows if row.num_new_tokens == 1]
        tokens = len(decode)
        expected = float(sum(row.num_logits for row in decode))
        if not isinstance(self.drafter, ModelDrafter):
            lengths, _ = _allocate(
                self._rates(rows, limits, self.acceptance, self.prior),
                limits,
                budget,
                expected,
                tokens,
                (c0, c1, 0.0, 0.0),
            )
            self._probe(rows, limits, lengths, budget, self.acceptance, self.prior, model=False)
            return lengths, set()
        # a model drafter's drafts also cost their proposing on rank 0: d0 per draft step, d1 per token
        d0, d1 = self.draft_cost.coefficients()
        cost = (c0, c1, d0, d1)
        bar = expected / (c0 + c1 * tokens)  # expected tokens per second without drafts
        lengths, speed = _allocate(
            self._rates(rows, limits, self.acceptance, self.prior), limits, budget, expected, tokens, cost
        )
        # the draft model runs only where the plan expects a clear gain: near break-even the cost
        # model's error and the drafts' own variance make it a loss as often as a gain
        if speed < (1 + _MODEL_MARGIN) * bar:
            lengths = {i: 0 for i in limits}
        elif not self.draft_cost.seen:  # its cost is not known yet: measure it on one row first
            first = max(lengths, key=lengths.__getitem__)
            lengths = {i: lengths[i] if i == first else 0 for i in limits}
        if self._plans % _MODEL_PROBE_EVERY in (0, _MODEL_PROBE_EVERY - 1):  # a probe is near: may it run?
            optimistic = _allocate({i: _OPTIMISTIC_RATE for i in limits}, limits, budget, expected, tokens, cost)
            self._model_drafting_pays = optimistic[1] >= (1 + _MODEL_MARGIN) * bar
        budget = self._probe(rows, limits, lengths, budget, self.acceptance, self.prior, model=True)
        free = {i: cap for i, cap in limits.items() if lengths[i] == 0}
        from_lookup: set[int] = set()
        if self.lookup is not None and free and budget > 0:
            # prompt lookup drafts for the rows the draft model does not (all of them where it does
            # not pay), judged like an n-gram drafter's: its acceptance, no proposing cost
            taken = sum(lengths.values())
            lookup, _ = _allocate(
                self._rates(rows, free, self.lookup_acceptance, self.lookup_prior),
                free,
                budget,
                expected,
                tokens + taken,
                (c0 + c1 * taken, c1, 0.0, 0.0),
            )
            self._probe(rows, free, lookup, budget, self.lookup_acceptance, self.lookup_prior, model=False)
            for i, k in lookup.items():
                if k > 0:
                    lengths[i] = k
                    from_lookup.add(i)
        return lengths, from_lookup

    def _rates(
        self, rows: list[ScheduledRow], limits: dict[int, int], acceptance: dict[str, _Acceptance], prior: float
    ) -> dict[int, float]:
        return {i: acceptance.get(rows[i].request.request_id, _Acceptance(prior)).rate for i in limits}

    def _probe(
        self,
        rows: list[ScheduledRow],
        limits: dict[int, int],
        lengths: dict[int, int],
        budget: int,
        acceptance: dict[str, _Acceptance],
        prior: float,
        model: bool,
    ) -> int:
        """Give a request that stopped drafting a probe now and then, to notice a change; note what
        was planned for each. Returns the budget left."""
        budget -= sum(lengths[i] for i in limits)
        for i in limits:
            stats = acceptance.setdefault(rows[i].request.request_id, _Acceptance(prior))
            if lengths[i] == 0:
                stats.steps_without_drafts += 1
                if model:
                    stats.off = stats.off or stats.probes >= _MODEL_PROBES_BEFORE_OFF
                    due = (
                        not stats.off
                        and self._model_drafting_pays
                        and self._plans % _MODEL_PROBE_EVERY == 0
                        and stats.steps_without_drafts > 1
                    )
                else:
                    due = stats.steps_without_drafts >= _PROBE_EVERY
                if due and budget > 0:
                    lengths[i], stats.steps_without_drafts = 1, 0
                    stats.probes += 1
                    budget -= 1
            else:
                stats.steps_without_drafts = stats.probes = 0
            stats.planned = lengths[i]
        return budget

    def _propose(self, request: Request, drafter: Drafter, forced: list[int], max_len: int) -> list[int]:
        """The forced tokens, then up to ``max_len`` of the drafter's tokens after them."""
        request_id = request.request_id
        guided = request.guided
        drafts = list(forced)
        if max_len > 0:
            context = request.prompt_token_ids + request.output_token_ids
            num_committed = len(context)
            prefix = list(drafts)

            def valid_prefix(tokens: Any) -> int:
                if guided and self.cfg.constrain_drafts:
                    return int(self.grammar.valid_prefix(request_id, prefix, tokens))
                return len(tokens)

            proposed = drafter.propose(request_id, context + drafts, num_committed, max_len, valid_prefix)
            if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in proposed):
                raise ValueError(f"the drafter proposed a token id outside the vocabulary [0, {self.vocab_size})")
            drafts += proposed
        return drafts


def _allocate(
    rates: dict[int, float],
    limits: dict[int, int],
    budget: int,
    expected: float,
    tokens: int,
    cost: tuple[float, float, float, float],
) -> tuple[dict[int, int], float]:
    """Draft lengths per row, added one token at a time where the next draft is worth the most
    (``rate ** j``) while it raises expected tokens per second; returns them with that speed.
    ``cost``: (c0, c1, d0, d1): a step's ``c0 + c1 * tokens``, plus ``d0`` per draft step (the
    longest row's length) and ``d1`` per draft token proposed."""
    c0, c1, d0, d1 = cost
    lengths = {i: 0 for i in limits}
    drafts = longest = 0

    def seconds(tokens: int, drafts: int, longest: int) -> float:
        return c0 + c1 * tokens + d0 * longest + d1 * drafts

    # each row's next draft token, by its gain (the first row on a tie)
    heap = [(-rates[i], order, i) for order, i in enumerate(limits) if limits[i] > 0]
    heapq.heapify(heap)
    while budget > 0 and heap:
        gain, order, best = -heap[0][0], heap[0][1], heap[0][2]
        longer = max(longest, lengths[best] + 1)
        if (expected + gain) * seconds(tokens, drafts, longest) <= expected * seconds(tokens + 1, drafts + 1, longer):
            break  # one more draft token would lower tokens per second
        lengths[best] += 1
        if lengths[best] < limits[best]:
            heapq.heapreplace(heap, (-(rates[best] ** (lengths[best] + 1)), order, best))
        else:
            heapq.heappop(heap)
        expected += gain
        tokens += 1
        drafts += 1
        longest = longer
        budget -= 1
    return lengths, expected / seconds(tokens, drafts, longest)


def _kv_room(request: Request, end: int) -> int:
    """Positions past ``end`` that the request's KV blocks hold (what the batcher reserved)."""
    return request.blocks.capacity - end if request.blocks is not None else 1 << 30
