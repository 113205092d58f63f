"""A request's state inside the scheduler: a few counters with stated invariants.

There is no prefill phase and decode phase: a request has ``num_tokens`` known tokens
(prompt + output) of which ``num_computed_tokens`` are in the KV cache; each step computes
some of the rest. Invariant: 0 <= num_computed_tokens <= num_known_tokens <= max_model_len.

With a step run ahead (async scheduling, ``scheduler.py``), a request may have one more token
than it knows: the token an in-flight step samples for it (``pending_step``), which the next
step already runs as ``LAST_SAMPLED`` (the workers put the token they sampled in its place).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from guidespec.protocol import LAST_SAMPLED, DecodeStats, SamplingParams
from guidespec.scheduler.kv_blocks import BlockTable


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# the members, for the loops over a step's rows: a lookup on an Enum class costs ~0.14 µs (Python
# 3.11), a module global ~0.04
RUNNING, FINISHED = Status.RUNNING, Status.FINISHED


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    slot: int | None = None  # its row state on the workers, while running
    blocks: BlockTable | None = None  # its KV cache blocks, while running (batching.py)
    prompt_keys: list[bytes] = field(default_factory=list)  # its full blocks' keys (Batcher._prompt_keys)
    prompt_keys_for: int = -1  # the token count they were computed for
    status: Status = Status.WAITING
    sent_token_count: int = 0
    first_token_time: float = 0.0
    finish_reason: str | None = None
    grammar_ready: bool = True  # False while its grammar compiles (its prompt may be prefilled meanwhile)
    compiling_since: float = 0.0  # time.monotonic() when its compile began
    # its prompt's last token ran while its grammar still compiled and the mask did not come in time:
    # that token runs again once the grammar is ready (``batching.py``)
    mask_came_late: bool = False
    grammar_backend: str = ""  # the backend enforcing its grammar, once ready
    grammar_refusal: str = ""  # why a backend before it refused (backend "auto"), if one did
    draft_tokens: list[int] = field(default_factory=list)  # this step's drafts, after the known tokens
    # the in-flight step whose sampled token the next step runs before the scheduler has it (-1: none)
    pending_step: int = -1
    # its grammar's answer to the step's first token, asked before the rest of the emit
    # (``Emitter.advance_grammars``): (token, accepted, the grammar has terminated)
    advanced: tuple[int, bool, bool] | None = None
    stream: bool = True  # the client takes its deltas as they come (else only the finished output)
    restarted: bool = False  # started again after its grammar failed; its next delta says so
    stats: DecodeStats = field(default_factory=DecodeStats)

    @property
    def guided(self) -> bool:
        return self.params.guided is not None

    @property
    def sends_each_step(self) -> bool:
        """Its deltas go to the client each step: it streams, or has stop strings (the client's
        to find: ``output_text``)."""
        return self.stream or bool(self.params.stop)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Its tokens, with the one an in-flight step samples for it (``pending_step``)."""
        return self.num_tokens + (self.pending_step >= 0)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_at(self, position: int) -> int:
        """The token at a position: prompt, then output, then this step's drafts (or the token an
        in-flight step samples, ``LAST_SAMPLED``)."""
        n = len(self.prompt_token_ids)
        if position < n:
            return self.prompt_token_ids[position]
        m = len(self.output_token_ids)
        if position - n < m:
            return self.output_token_ids[position - n]
        return LAST_SAMPLED if self.pending_step >= 0 else self.draft_tokens[position - n - m]

    def tokens(self, start: int, end: int) -> list[int]:
        return [self.token_at(p) for p in range(start, end)]

    def advance_computed(self, count: int) -> None:
        self.num_computed_tokens += count
        assert 0 <= self.num_computed_tokens <= self.num_known_tokens, (self.num_computed_tokens, self.num_tokens)

    @property
    def finished(self) -> bool:
        return self.status is FINISHED
