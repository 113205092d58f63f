"""The shared nouns: sampling parameters and every message that crosses a process boundary.

Each message is a small dataclass registered under a fixed tag (see ``guidespec.ipc.codec``);
arrays travel as numpy arrays (raw bytes + dtype + shape on the wire). Nothing here knows
about sockets or rings; nothing here is ever pickled.

Messages by direction:
- client -> scheduler: GenerateRequest, AbortRequest, Shutdown
- scheduler -> client: EngineReady, RequestOutput, EngineDead
- scheduler -> workers (ring): StepInputs, StepBitmask (the step's second broadcast), Shutdown
- workers -> scheduler: WorkerReady, StepOutputs (rank 0), WorkerError
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from guidespec import envs
from guidespec.ipc.codec import register_message

GREEDY = 0.0
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
GRAMMAR_BACKENDS = ("xgrammar", "llguidance")
# "auto": the first of these that enforces the grammar exactly (the other where one refuses)
AUTO_BACKEND_ORDER = ("xgrammar", "llguidance")


def backend_order(backend: str) -> tuple[str, ...]:
    """The backends a choice stands for, in the order they are tried ("auto": each in turn, as
    ``GUIDESPEC_AUTO_BACKENDS`` orders them where it is set)."""
    if backend != "auto":
        return (backend,)
    order = envs.auto_backends()
    if order is None:
        return AUTO_BACKEND_ORDER
    unknown = [name for name in order if name not in GRAMMAR_BACKENDS]
    if unknown or len(set(order)) != len(order):
        raise ValueError(f"GUIDESPEC_AUTO_BACKENDS={','.join(order)}: name each of {', '.join(GRAMMAR_BACKENDS)} once")
    return order


BACKEND_CHOICES = ("auto", *GRAMMAR_BACKENDS)

# What one request may carry (validate_request): every number fits the engine's int32 / float32
# arrays and keeps its maths finite; sizes bound the scheduler's per-step work per request.
INT32_MAX = 2**31 - 1
BAD_REQUEST, INTERNAL_ERROR, ENGINE_UNAVAILABLE = 400, 500, 503  # RequestOutput.error_status
# RequestOutput.error_code of a request whose grammar stopped before its output was complete (a
# backend's limit met mid-way): a 500 of its own, never an answer that ends with "stop"
GRAMMAR_FAILED = "grammar_failed"
MAX_TEMPERATURE = 100.0  # float32 logits / temperature stay finite and masked rows stay -inf
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-4, 1e4
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 64, 1024, 1024
MAX_GRAMMAR_CHARS = 1 << 20  # a JSON schema's text or an EBNF / Lark grammar
MAX_REGEX_CHARS = 1 << 16
MAX_SCHEMA_DEPTH = 128  # nesting of the schema document (JSONSchemaBench's deepest: 34)
MAX_CHOICES = 4096


class InvalidRequest(ValueError):
    """A request the engine cannot serve, by the client's fault; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """The one check every request passes, in the client (``LLM``, and the server through it) and
    again in the scheduler: raises InvalidRequest before anything reaches a worker."""
    validate_prompt(prompt_token_ids, vocab_size, max_model_len)
    if not isinstance(params, SamplingParams):
        raise InvalidRequest("sampling parameters must be a SamplingParams", "sampling_params")
    params.validate(vocab_size)


def validate_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    ids = prompt_token_ids
    if not isinstance(ids, list) or not ids:
        raise InvalidRequest("the prompt is empty", "prompt")
    if len(ids) >= max_model_len:
        raise InvalidRequest(
            f"the prompt has {len(ids)} tokens, the model length is {max_model_len}: shorten it or raise max_model_len",
            "prompt",
        )
    bad = next((t for t in ids if not _is_int(t) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"prompt token ids must be integers in [0, {vocab_size}) (the model's vocabulary), got {_short(bad)}",
            "prompt",
        )


@register_message(2)
@dataclass(frozen=True)
class GuidedDecoding:
    """One constraint on the output. Set exactly one of the fields; ``backend`` overrides the engine's.

    ``json_schema`` is the schema as JSON text (or a dict, turned into text); ``grammar`` is EBNF
    for xgrammar or Lark for llguidance; ``choice`` is a list of allowed outputs.
    ``close_early`` (JSON kinds only): when the output starts repeating a cycle or nears
    ``max_tokens``, prefer tokens that close the JSON wherever the grammar allows one
    (``guidespec/scheduler/grammar/closing.py``), so the output ends valid instead of being cut.
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    backend: str | None = None
    close_early: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        set_kinds = [k for k in GRAMMAR_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                f"guided decoding needs exactly one of {', '.join(GRAMMAR_KINDS)}; got {set_kinds or 'none'}"
            )
        return set_kinds[0]

    def validate(self) -> None:
        """Raise InvalidRequest naming the first bad field: the kind, its size, a schema's nesting."""
        try:
            kind = self.kind
        except ValueError as e:
            raise InvalidRequest(str(e), "guided") from None
        value = getattr(self, kind)
        if kind in ("json_schema", "regex", "grammar") and (not isinstance(value, str) or not value):
            raise InvalidRequest(f"{kind} must be a non-empty string", kind)
        if kind in ("json_schema", "grammar") and len(value) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"{kind} has {len(value)} characters; the limit is {MAX_GRAMMAR_CHARS}", kind)
        if kind == "regex" and len(value) > MAX_REGEX_CHARS:
            raise InvalidRequest(f"regex has {len(value)} characters; the limit is {MAX_REGEX_CHARS}", kind)
        if kind == "json_schema":
            _check_schema(value)
        if kind == "json_object" and value is not True:
            raise InvalidRequest("json_object must be true or absent", kind)
        if kind == "choice":
            _check_choices(value)
        if self.backend is not None and self.backend not in BACKEND_CHOICES:
            raise InvalidRequest(
                f"unknown grammar backend {self.backend!r}; choose one of {', '.join(BACKEND_CHOICES)}", "backend"
            )
        if not isinstance(self.close_early, bool):
            raise InvalidRequest("close_early must be a boolean", "close_early")

    def cache_key(self, backend: str) -> str:
        """The canonical grammar: equal keys compile to the same grammar."""
        kind = self.kind
        value: object = getattr(self, kind)
        if kind == "json_schema":
            value = json.loads(value)  # type: ignore[arg-type]
        return json.dumps([backend, kind, value], sort_keys=True, separators=(",", ":"))


@register_message(1)
@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    guided: GuidedDecoding | None = None
    repetition_penalty: float = 1.0  # > 1 discourages every token already in the prompt or output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    presence_penalty: float = 0.0  # subtracted once if the token occurs in the output
    speculative: bool = True  # use the engine's drafter for this request (if it has one)
    max_draft_len: int | None = None  # at most this many draft tokens per step (None: the engine's)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):  # anything else is left for validate() to refuse
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequest naming the first bad field. Every number must fit the engine's
        arrays (int32 / float32) and keep its maths finite; token ids need ``vocab_size``."""
        _check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE, "(0 = greedy)")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        _check_int("top_k", self.top_k, 0, INT32_MAX, "(0 disables it)")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**63 - 1)
        if (
            not isinstance(self.stop, tuple)
            or len(self.stop) > MAX_STOP_STRINGS
            or any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS for s in self.stop)
        ):
            raise InvalidRequest(
                f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters",
                "stop",
            )
        if not isinstance(self.stop_token_ids, tuple) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids", "stop_token_ids")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, 0, (vocab_size or INT32_MAX + 1) - 1, "(a token id of the model)")
        for name in ("ignore_eos", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name} must be a boolean", name)
        _check_float("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        for name in ("frequency_penalty", "presence_penalty"):
            _check_float(name, getattr(self, name), -2.0, 2.0)
        if self.max_draft_len is not None:
            _check_int("max_draft_len", self.max_draft_len, 0, 16)
        if self.guided is not None:
            if not isinstance(self.guided, GuidedDecoding):
                raise InvalidRequest("guided must be a GuidedDecoding", "guided")
            self.guided.validate()

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == GREEDY


# ---------------------------------------------------------------- client <-> scheduler


@register_message(10)
@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: np.ndarray  # [num_prompt_tokens] int32
    params: SamplingParams
    arrival_time: float
    # whether the client takes deltas as they come; without, the scheduler sends the finished
    # output alone (and each step's tokens where the request has stop strings, which the client
    # finds), and until then may start the request again (``RequestTable.grammar_failed``)
    stream: bool = True


@register_message(11)
@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@register_message(12)
@dataclass(frozen=True)
class Shutdown:
    reason: str = ""


@register_message(13)
@dataclass(frozen=True)
class EngineReady:
    num_workers: int
    max_batch_size: int
    max_model_len: int
    num_kv_blocks: int = 0  # the KV cache's pool (the smallest any rank holds)
    kv_block_size: int = 0


@register_message(17)
@dataclass(frozen=True)
class SchedulerStats:
    """Scheduler -> client, when they change (at most every ``_STATS_INTERVAL_S`` of ``scheduler.py``): the queue as the
    server's /metrics shows it."""

    running: int  # requests holding a slot
    waiting: int  # requests queued for a slot (their grammar ready, or unguided)
    waiting_for_grammar: int  # requests whose grammar is still compiling
    free_slots: int
    kv_blocks_used: int = 0  # blocks held by running requests (cached blocks held by none are free)
    kv_blocks_total: int = 0
    kv_blocks_written: int = 0  # blocks ever written (the pool's high-water mark: on the CPU, its resident part)
    # since start, in tokens: prompt tokens looked up in the prefix cache, and those found there
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0  # requests sent back to the queue for want of blocks (recomputed later)
    # since start: grammars compiled, and grammars found compiled by another engine (grammar_cache_dir)
    grammars_compiled: int = 0
    grammars_shared: int = 0

    @classmethod
    def total(cls, parts: list[Any]) -> SchedulerStats:
        """Several engines' figures added up (data-parallel replicas), from stats or their dicts."""
        rows = [dataclasses.asdict(x) if isinstance(x, SchedulerStats) else x for x in parts]
        return cls(**{f.name: sum(int(r.get(f.name, 0)) for r in rows) for f in dataclasses.fields(cls)})


@register_message(16)
@dataclass
class DecodeStats:
    """A request's decoding figures so far: steps, and what speculation drafted and accepted."""

    num_steps: int = 0  # target steps that produced tokens for it
    num_spec_steps: int = 0  # of those, steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_histogram: list[int] = field(default_factory=list)  # [n]: spec steps that accepted n drafts
    num_cached_tokens: int = 0  # prompt tokens whose KV cached blocks held (prefix caching): not computed
    num_preemptions: int = 0  # times it gave its blocks back and went back to the queue (recomputed)
    # times it started again on the next backend of "auto" after its grammar failed mid-way
    grammar_restarts: int = 0

    def record_step(self, num_drafts: int, num_accepted: int) -> None:
        self.num_steps += 1
        if num_drafts == 0:
            return
        self.num_spec_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_histogram) <= num_accepted:
            self.accepted_histogram.append(0)
        self.accepted_histogram[num_accepted] += 1

    @property
    def mean_accepted_tokens_per_step(self) -> float:
        """Tokens per speculative step, the target's own token included (1.0 without speculation)."""
        return 1.0 + self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else 1.0

    @property
    def mean_draft_length(self) -> float:
        """Draft tokens per speculative step."""
        return self.num_draft_tokens / self.num_spec_steps if self.num_spec_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@register_message(14)
@dataclass(frozen=True)
class RequestOutput:
    """A delta for one request: the tokens produced since the previous output (and their text,
    which the client adds: ``new_text``)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_prompt_tokens: int = 0
    first_token_time: float = 0.0  # scheduler clock (time.time()) of the first output token
    # the request's (a copy): with its finishing delta, and with each one of a request with stop
    # strings (the client may end it at any of them)
    stats: DecodeStats | None = None
    # with an error: whose fault, as an HTTP status: BAD_REQUEST (the request's), INTERNAL_ERROR
    # (ours, this request alone), ENGINE_UNAVAILABLE (the engine died; retry after its restart)
    error_status: int = 0
    grammar_backend: str = ""  # the backend that enforces the request's grammar
    grammar_refusal: str = ""  # why the one tried before it (backend "auto") refused, if one did
    error_code: str = ""  # with an error, its kind where it has one of its own (GRAMMAR_FAILED)
    # the request started again (its grammar failed: ``RequestTable.grammar_failed``): the tokens
    # sent before this delta are void (only a request the client does not stream starts again)
    restarted: bool = False
    # the text of ``new_token_ids``: the client's to make (``output_text``), so never the engine's
    new_text: str = ""


@register_message(18)
@dataclass(frozen=True)
class RequestOutputs:
    """A step's deltas, in one message: one socket send a step rather than one per request."""

    outputs: list[RequestOutput]


@register_message(15)
@dataclass(frozen=True)
class EngineDead:
    reason: str


# ---------------------------------------------------------------- scheduler <-> workers


@register_message(20)
@dataclass(frozen=True)
class StepInputs:
    """The first broadcast of a step: everything the forward pass needs.

    Row ``i`` of the batch is request in slot ``slots[i]``; it runs ``num_new_tokens[i]``
    tokens starting at position ``start_positions[i]``, and wants logits for its last
    ``num_logits[i]`` positions (0 for a prefill chunk that does not finish the prompt; later,
    1 + draft length for verification). A slot's KV lives in the blocks its table lists; the
    tables that changed since the last step come with it (``table_*``: slot ``table_slots[j]``'s
    table is the next ``table_lens[j]`` of ``table_blocks``).
    """

    step: int
    slots: np.ndarray  # [B] int32
    start_positions: np.ndarray  # [B] int32
    num_new_tokens: np.ndarray  # [B] int32
    token_ids: np.ndarray  # [sum(num_new_tokens)] int32
    num_logits: np.ndarray  # [B] int32
    temperature: np.ndarray  # [B] float32
    top_k: np.ndarray  # [B] int32
    top_p: np.ndarray  # [B] float32
    seeds: np.ndarray  # [B] int64, -1 = unseeded
    sample_index: np.ndarray  # [B] int32, output tokens so far (seeded RNG stream position)
    num_prompt_tokens: np.ndarray  # [B] int32
    penalties: np.ndarray  # [B, 3] float32: repetition, frequency, presence
    has_bitmask: bool = False  # a StepBitmask for this step follows on the ring
    draft_lens: np.ndarray | None = None  # [B] int32: draft-model proposals wanted after this step (None: none)
    draft_masked: np.ndarray | None = None  # [B] int32: a row's draft steps that wait for a DraftMask, from the first
    table_slots: np.ndarray | None = None  # [U] int32: slots whose block table changed
    table_lens: np.ndarray | None = None  # [U] int32
    table_blocks: np.ndarray | None = None  # [sum(table_lens)] int32

    @property
    def batch_size(self) -> int:
        return int(self.slots.shape[0])

    @functools.cached_property
    def penalized(self) -> np.ndarray:
        """[B] bool: the rows that ask for a repetition, frequency or presence penalty (kept: a
        step asks several times; a StepInputs derived from this one shares its penalties)."""
        return (self.penalties != _NO_PENALTIES).any(axis=1)


_NO_PENALTIES = np.array([1.0, 0.0, 0.0], np.float32)  # StepInputs.penalties of a row that asks for none


@register_message(28)
@dataclass(frozen=True)
class StepNext:
    """A steady decode step's first broadcast, in place of its StepInputs: the step before's
    rows again (or those of them ``keep`` names: requests that ended drop out), each one
    position on. Sent only where the step before was all decode rows (one new token, its logits,
    no drafts) and this one has those requests, in the same slots and order, each one token
    further and one more sample in: every rank then derives the step's StepInputs from the one
    before (:func:`next_inputs`) instead of the scheduler building and every rank decoding all of
    its arrays. Its size does not grow with the batch unless tokens, block tables or a row's
    end come with it."""

    step: int
    token_ids: np.ndarray | None = None  # [B] int32; None: every row's is LAST_SAMPLED
    has_bitmask: bool = False
    table_slots: np.ndarray | None = None  # as StepInputs'
    table_lens: np.ndarray | None = None
    table_blocks: np.ndarray | None = None
    keep: np.ndarray | None = None  # [B] int32: the rows of the step before that go on, in order (None: all)


def next_inputs(before: StepInputs, message: StepNext) -> StepInputs:
    """The StepInputs ``message`` stands for, after ``before`` (the last step's, as received or
    derived). The arrays that do not change are ``before``'s own (read-only: decoded ones are
    views of an immutable frame; derived ones are never written)."""
    keep = message.keep
    if keep is not None:
        if (
            keep.ndim != 1
            or not len(keep)
            or (np.diff(keep) <= 0).any()
            or not 0 <= keep[0] <= keep[-1] < before.batch_size
        ):
            raise ValueError(f"step {message.step}: rows to keep {keep.tolist()} of {before.batch_size}")
        before = _rows_of(before, keep)
    size = before.batch_size
    token_ids = message.token_ids
    if token_ids is None:
        token_ids = _last_sampled_row(size)
    elif token_ids.shape != (size,):
        raise ValueError(f"step {message.step}: {token_ids.shape[0]} tokens for {size} rows")
    derived = object.__new__(StepInputs)  # (the dataclass's __init__ and frozen checks: ~6 µs a step)
    derived.__dict__.update(
        before.__dict__,
        step=message.step,
        start_positions=before.start_positions + 1,
        token_ids=token_ids,
        sample_index=before.sample_index + 1,
        has_bitmask=message.has_bitmask,
        table_slots=message.table_slots,
        table_lens=message.table_lens,
        table_blocks=message.table_blocks,
    )
    return derived


def _rows_of(inputs: StepInputs, rows: np.ndarray) -> StepInputs:
    """The per-row arrays of ``inputs`` (decode rows: a token each) at ``rows``."""
    taken = object.__new__(StepInputs)
    taken.__dict__.update(
        {name: value for name, value in inputs.__dict__.items() if name != "penalized"},  # (per row: made again)
        **{name: getattr(inputs, name)[rows] for name in _PER_ROW},
    )
    return taken


_PER_ROW = (
    "slots",
    "start_positions",
    "num_new_tokens",
    "token_ids",
    "num_logits",
    "temperature",
    "top_k",
    "top_p",
    "seeds",
    "sample_index",
    "num_prompt_tokens",
    "penalties",
)


def follows_as_next(inputs: StepInputs) -> bool:
    """Whether a StepNext may follow ``inputs``: every row a decode row (one new token, its
    logits) and no drafts wanted."""
    return (
        inputs.draft_lens is None and bool((inputs.num_new_tokens == 1).all()) and bool((inputs.num_logits == 1).all())
    )


def all_last_sampled(token_ids: np.ndarray) -> bool:
    """Whether ``token_ids`` is a StepNext's that sent none: every row's is ``LAST_SAMPLED``
    (known by identity: no comparison a step)."""
    return token_ids is _LAST_SAMPLED_ROWS.get(len(token_ids))


_LAST_SAMPLED_ROWS: dict[int, np.ndarray] = {}


def _last_sampled_row(size: int) -> np.ndarray:
    row = _LAST_SAMPLED_ROWS.get(size)
    if row is None:
        row = np.full(size, LAST_SAMPLED, np.int32)
        row.setflags(write=False)
        _LAST_SAMPLED_ROWS[size] = row
    return row


@register_message(21)
@dataclass(frozen=True)
class StepBitmask:
    """The second broadcast: one int32 bitmask row per logits row of a guided request."""

    step: int
    rows: np.ndarray  # [R] int32: which logits rows the bitmask rows apply to
    bitmask: np.ndarray | None  # [R, ceil(vocab / 32)] int32; None when the rows are in the arena
    arena_buffer: int = -1  # >= 0: the rows are in this buffer of the mask arena (ipc/mask_arena.py)


NO_TOKEN = -1  # a StepOutputs token where the row's mask allowed no token at all
# a StepInputs token the workers take from what they sampled for the row's slot in the step before
# (a step run ahead of its predecessor's outputs: async scheduling)
LAST_SAMPLED = -1


@register_message(22)
@dataclass(frozen=True)
class StepOutputs:
    step: int
    token_ids: np.ndarray  # [sum(num_tokens)] int32, the tokens each row produced
    num_tokens: np.ndarray  # [B] int32
    forward_s: float = 0.0  # rank 0's step until its tokens were picked, less its wait for the bitmask
    timings: np.ndarray | None = None  # [4] float64 wall times: forward start, forward end, mask ready, done
    draft_tokens: np.ndarray | None = None  # [sum(num_draft_tokens)] int32: the draft model's proposals
    num_draft_tokens: np.ndarray | None = None  # [B] int32, they follow each row's last produced token
    draft_s: float = 0.0  # seconds rank 0 spent proposing (draft model / EAGLE head), not in forward_s
    fused: bool = False  # the whole step ran as one graph (worker/drafting/step_graph.py): forward_s holds its drafting
    # rank 0's waits for grammar masks beyond the bitmask's (timings): [m, 3] float64 rows of (draft
    # index, -2 for a fused step's verify masks; wait start; wait end), wall times; inside graphs the
    # trampolines time them (the device stood still meanwhile)
    mask_waits: np.ndarray | None = None


@register_message(27)
@dataclass(frozen=True)
class MaskWanted:
    """Rank 0 -> scheduler: the forward of ``step`` is done and its bitmask has not come (the
    scheduler may be holding it back for a grammar that still compiles: it then stops waiting)."""

    step: int


@register_message(25)
@dataclass(frozen=True)
class DraftTokens:
    """Rank 0 -> scheduler, during the draft loop of ``step``: for each guided row about to choose
    its draft number ``draft_index`` (from 0), every token past the request's last final one
    (this step's produced tokens, then the drafts so far), so the scheduler can fill its mask."""

    step: int
    draft_index: int
    rows: np.ndarray  # [R] int32 batch rows
    token_ids: np.ndarray  # [sum(num_tokens)] int32
    num_tokens: np.ndarray  # [R] int32


@register_message(26)
@dataclass(frozen=True)
class DraftMask:
    """Scheduler -> workers (ring): the masks for a DraftTokens, one row per row it named."""

    step: int
    draft_index: int
    bitmask: np.ndarray  # [R, ceil(vocab / 32)] int32


@register_message(23)
@dataclass(frozen=True)
class WorkerReady:
    rank: int
    pid: int
    num_kv_blocks: int = 0  # the blocks of this rank's KV pool (the scheduler allocates the smallest rank's)


@register_message(24)
@dataclass(frozen=True)
class WorkerError:
    rank: int
    message: str  # one line: what failed (sent on to clients)
    step: int = -1
    details: str = ""  # the traceback: for the scheduler's log only, never a response


# ---------------------------------------------------------------- checks


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, (float, np.floating))) and math.isfinite(value)  # type: ignore[arg-type]


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_int(name: str, value: object, low: int, high: int, note: str = "") -> None:
    if not (_is_int(value) and low <= value <= high):  # type: ignore[operator]
        raise InvalidRequest(
            f"{name} must be an integer in [{low}, {high}]{' ' + note if note else ''}, got {_short(value)}", name
        )


def _check_float(name: str, value: object, low: float, high: float, note: str = "") -> None:
    if not (_is_number(value) and low <= value <= high):  # type: ignore[operator]
        raise InvalidRequest(
            f"{name} must be a number in [{low:g}, {high:g}]{' ' + note if note else ''}, got {_short(value)}", name
        )


def _check_schema(text: str) -> None:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"json_schema is not valid JSON: {e}", "json_schema") from None
    except RecursionError:
        raise InvalidRequest(f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels", "json_schema") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest("json_schema must be a JSON object (or true/false)", "json_schema")
    stack: list[tuple[object, int]] = [(schema, 1)]
    while stack:  # no recursion: the depth is what is being checked
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequest(f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels", "json_schema")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def _check_choices(choices: object) -> None:
    if not isinstance(choices, tuple) or not choices or len(choices) > MAX_CHOICES:
        raise InvalidRequest(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings", "choice")
    if not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequest("choice must be a list of non-empty strings", "choice")
    if sum(len(c) for c in choices) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"choice has more than {MAX_GRAMMAR_CHARS} characters in all", "choice")
