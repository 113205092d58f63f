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

import json
import math
from dataclasses import dataclass, field

import numpy as np

from guidespec.ipc.codec import register_message

GREEDY = 0.0
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
GRAMMAR_BACKENDS = ("xgrammar", "llguidance")


@register_message(2)
@dataclass(frozen=True)
class GuidedDecoding:
    """One constraint on the output. Set exactly one of the fields; ``backend`` overrides the engine's.

    ``json_schema`` is the schema as JSON text (or a dict, turned into text); ``grammar`` is EBNF
    for xgrammar or Lark for llguidance; ``choice`` is a list of allowed outputs.
    ``close_early`` (JSON kinds only): when the output starts repeating a cycle or nears
    ``max_tokens``, prefer tokens that close the JSON wherever the grammar allows one
    (``guidespec/scheduler/closing.py``), so the output ends valid instead of being cut.
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
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        set_kinds = [k for k in GRAMMAR_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"guided decoding needs exactly one of {', '.join(GRAMMAR_KINDS)}; got {set_kinds or 'none'}")
        return set_kinds[0]

    def validate(self) -> None:
        kind = self.kind
        if kind == "json_schema":
            try:
                schema = json.loads(self.json_schema)  # type: ignore[arg-type]
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json_schema must be a JSON object (or true/false)")
        if kind == "choice" and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        if kind in ("regex", "grammar") and not getattr(self, kind):
            raise ValueError(f"{kind} must not be empty")
        if self.backend is not None and self.backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"unknown grammar backend {self.backend!r}; choose one of {', '.join(GRAMMAR_BACKENDS)}")

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
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {list(self.stop)!r}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if self.max_draft_len is not None and not (isinstance(self.max_draft_len, int) and 0 <= self.max_draft_len <= 16):
            raise ValueError(f"max_draft_len must be an integer in [0, 16], got {self.max_draft_len!r}")
        if self.guided is not None:
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


@register_message(17)
@dataclass(frozen=True)
class SchedulerStats:
    """Scheduler -> client, when they change (at most every ``stats_interval``): the queue as the
    server's /metrics shows it."""

    running: int  # requests holding a slot
    waiting: int  # requests queued for a slot (their grammar ready, or unguided)
    waiting_for_grammar: int  # requests whose grammar is still compiling
    free_slots: int


@register_message(16)
@dataclass
class DecodeStats:
    """A request's decoding figures so far: steps, and what speculation drafted and accepted."""

    num_steps: int = 0  # target steps that produced tokens for it
    num_spec_steps: int = 0  # of those, steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_histogram: list[int] = field(default_factory=list)  # [n]: spec steps that accepted n drafts
    num_cached_tokens: int = 0  # prompt tokens whose KV a free slot still held (prefix caching): not computed

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
    """A delta for one request: the tokens and text produced since the previous output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_prompt_tokens: int = 0
    first_token_time: float = 0.0  # scheduler clock (time.time()) of the first output token
    stats: DecodeStats | None = None  # so far (a copy)


@register_message(15)
@dataclass(frozen=True)
class EngineDead:
    reason: str


# ---------------------------------------------------------------- scheduler <-> workers


@register_message(20)
@dataclass(frozen=True)
class StepInputs:
    """The first broadcast of a step: everything the forward pass needs.

    Row ``i`` of the batch is request in KV slot ``slots[i]``; it runs ``num_new_tokens[i]``
    tokens starting at position ``start_positions[i]``, and wants logits for its last
    ``num_logits[i]`` positions (0 for a prefill chunk that does not finish the prompt; later,
    1 + draft length for verification).
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
    draft_masked: np.ndarray | None = None  # [B] bool: rows whose draft steps wait for a DraftMask

    @property
    def batch_size(self) -> int:
        return int(self.slots.shape[0])


@register_message(21)
@dataclass(frozen=True)
class StepBitmask:
    """The second broadcast: one int32 bitmask row per logits row of a guided request."""

    step: int
    rows: np.ndarray  # [R] int32: which logits rows the bitmask rows apply to
    bitmask: np.ndarray  # [R, ceil(vocab / 32)] int32


@register_message(22)
@dataclass(frozen=True)
class StepOutputs:
    step: int
    token_ids: np.ndarray  # [sum(num_tokens)] int32, the tokens each row produced
    num_tokens: np.ndarray  # [B] int32
    forward_s: float = 0.0
    timings: np.ndarray | None = None  # [4] float64 wall times: forward start, forward end, mask ready, done
    draft_tokens: np.ndarray | None = None  # [sum(num_draft_tokens)] int32: the draft model's proposals
    num_draft_tokens: np.ndarray | None = None  # [B] int32, they follow each row's last produced token
    draft_s: float = 0.0  # seconds rank 0 spent proposing (draft model / EAGLE head), not in forward_s


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


@register_message(24)
@dataclass(frozen=True)
class WorkerError:
    rank: int
    message: str
    step: int = -1


