"""Early closing of JSON outputs: a guided output that loops, or nears ``max_tokens``, is steered
to its end instead of being cut mid-value.

A small model under a JSON grammar can fall into a cycle (``"water", "water", ...``,
``1000000...``) that the grammar happily allows until ``max_tokens`` cuts it, and a cut JSON
document is invalid. While a request is *closing*, its bitmask row is narrowed to the first of
these that the grammar allows:

1. *closing tokens*: in a string, a quote then ``]``/``}`` (``"``, ``"}``); outside one, ``]``/``}``
   only, or a stop token (a top-level number ends with the output);
2. outside a string, *ending tokens*: a comma (a number before a required property ends there);
3. in a string, an *example* (with the grammar's view): the shortest string of a ``pattern`` in
   the schema (``exrex``) or of a ``format``, if the grammar accepts it here and lets the string
   end after it; its tokens are then written one by one (an unanchored ``hh:hh:hh:hh:hh``
   pattern that a looping model never writes);
4. *steps* (with the grammar's view): short tokens after which the grammar allows 1 or 2, else
   those that move the grammar to a different mask (``:`` leaves the ``[a-zA-Z]+`` loop of
   ``^[a-zA-Z]+://``, ``Z`` ends a time's fraction digits);
5. the tokens allowed but the ones of the cycles the output repeated (banned for the rest of the
   closing, so what no step reaches is at least written differently each time).

Where none is allowed the row is left as the grammar made it. The grammar alone still decides
validity: the narrowing never allows a token the grammar refused. (Preferring short values
where a value must come was tried and reverted: where the string scanner misses a quote it
forced digits inside a string until ``max_tokens``.)

A request starts closing when

- its last tokens repeat a cycle: for some period ``p`` the last ``max(2p, min_span)`` tokens
  equal the ``p`` tokens before them (three or more copies of the cycle), or
- fewer than ``reserve`` tokens of its ``max_tokens`` budget are left, or
- a dry run of closing from the grammar's state (``ClosingStep.dry_run``: this
  module's narrowing with the grammar alone choosing), and half as many tokens again, would no
  longer fit in what is left: a recursive schema's required structure can need hundreds of
  tokens (Github_hard o59999: ~760 from the start), far more than any fixed reserve.

Once the dry run alone only just fits what is left (8 tokens to spare), its tokens are written
as they are (``script``): each row allows only the next one. The model then has no choice left,
but the document ends valid within ``max_tokens`` whenever the dry run found it could.

While closing, a row where the grammar forces the next tokens (a required name) is left as the
grammar made it: narrowing it to the one-character steps would only spell the name out.

Switch it off per request with ``GuidedDecoding(close_early=False)``.
"""

from __future__ import annotations

import ctypes
import itertools
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np


from guidespec.bitmask import allowed_ids, bitmask_row
from guidespec.grammar_backends.interface import DATA_KEYWORDS
from guidespec.scheduler.grammar.narrowing import NARROWED, UNBANNED, Banned, Probe, Tiers, library, narrow_rows

MAX_PERIOD = 32
MIN_SPAN = 24
MAX_STEPS = 64  # lookahead candidates tried per closing row
_SPACES = ("Ġ", "▁", " ")  # how byte-level and sentencepiece vocabularies spell a space
_BRACKETS = frozenset("]}")
_ENDING = frozenset(",]}")

FORMAT_EXAMPLES = {
    "date-time": "2020-01-01T00:00:00Z",
    "date": "2020-01-01",
    "time": "00:00:00Z",
    "email": "a@example.com",
    "hostname": "example.com",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "uri": "http://example.com",
    "uri-reference": "/",
    "duration": "P1D",
}
MAX_EXAMPLES = 32
EXAMPLES_PER_PATTERN = 3
MAX_EXAMPLE_LEN = 256


class GrammarView(Protocol):
    """What closing may ask of the request's grammar (supplied by its owner; nothing is kept)."""

    def lookahead(self, candidates: Sequence[int], target: np.ndarray) -> tuple[list[int], list[int]]:
        """The candidates after which a token of ``target`` is allowed, and those after which the
        mask differs from the current one."""

    def completion(self, texts: Sequence[str], target: np.ndarray) -> list[int]:
        """The tokens of the first text the grammar accepts from here and after which a token of
        ``target`` is allowed; empty if none."""


def schema_examples(schema: Any) -> list[str]:
    """Short strings for the ``pattern``s, ``patternProperties`` names and ``format``s of a JSON
    schema: the first strings ``exrex`` generates for each pattern (minimal repeats, one per
    branch), a fixed example per format. Patterns exrex cannot read are skipped."""
    import exrex

    patterns: list[str] = []
    formats: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key in DATA_KEYWORDS:
                    continue
                if key == "pattern" and isinstance(value, str):
                    patterns.append(value)
                elif key == "format" and isinstance(value, str):
                    formats.append(value)
                elif key == "patternProperties" and isinstance(value, dict):
                    patterns.extend(value)
                walk(value)

    walk(schema)
    examples: list[str] = []
    for pattern in dict.fromkeys(patterns):
        try:  # the first few: each alternative of "^allow|deny$" (a string that began "dre" needs "deny")
            found = list(itertools.islice(exrex.generate(pattern, limit=4), EXAMPLES_PER_PATTERN))
        except Exception:  # exrex reads Python's regex dialect; some JSON Schema patterns are not
            continue
        examples += [e for e in found if len(e) <= MAX_EXAMPLE_LEN]
    examples += [FORMAT_EXAMPLES[f] for f in dict.fromkeys(formats) if f in FORMAT_EXAMPLES]
    return list(dict.fromkeys(examples))[:MAX_EXAMPLES]


@dataclass(frozen=True)
class ClosingTokens:
    """Bitmasks (packed int32, bit i of word i // 32) of the token classes closing steers to:
    ``in_string``: a quote then ``]``/``}`` (``"``, ``"]``, ``"}}``); ``outside``: ``]``/``}`` only,
    and the stop tokens; ``ending``: commas, maybe with brackets (``,``, ``},``); spaces may come
    before any of them. ``steps``: short tokens for the lookahead (one ASCII character, or up to
    three of punctuation; no quote or backslash, so a step never enters or leaves a string), tried in
    the order of ``step_rank`` (punctuation first)."""

    in_string: np.ndarray
    outside: np.ndarray
    ending: np.ndarray
    steps: np.ndarray
    step_rank: np.ndarray  # per token id: its place in the lookahead order
    piece_length: np.ndarray  # per token id: the length of its piece (0 for none)
    # the tokens whose text has a quote or a backslash: that text's quotes and backslashes, each
    # run of other characters as one "x" (what the string scanner needs: ``EarlyCloser.in_string``)
    quoting: dict[int, str]
    # one token for each printable ASCII character whose piece is that character alone: where a
    # grammar forces a text, its first character starts every token allowed, so a row allowing two
    # of these forces nothing (``forces_nothing``)
    singles: np.ndarray
    tiers_inside: Tiers = field(init=False, repr=False, compare=False)  # closing's classes in a string
    tiers_outside: Tiers = field(init=False, repr=False, compare=False)  # and outside one
    probe: Probe = field(init=False, repr=False, compare=False)  # the singles, for ``forces_nothing``

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers_inside", Tiers([self.in_string]))
        object.__setattr__(self, "tiers_outside", Tiers([self.outside, self.ending]))
        object.__setattr__(self, "probe", Probe(self.singles))

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = ()) -> "ClosingTokens":
        special = set(tokenizer.all_special_ids)
        in_string, outside, ending = [], list(stop_token_ids), []
        punctuation, characters, quoting = [], [], []
        singles: dict[str, int] = {}
        piece_length = np.zeros(vocab_size, dtype=np.int64)
        for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), vocab_size))))):
            if piece is None:
                continue
            piece_length[i] = len(piece)
            if '"' in piece or "\\" in piece or piece.startswith("<0x"):  # (a byte-fallback piece: <0x22>)
                quoting.append(i)
            if i in special:
                continue
            if len(piece) == 1 and "!" <= piece <= "~":
                singles.setdefault(piece, i)
            text = piece
            for space in _SPACES:
                text = text.replace(space, "")
            if not text:
                continue
            if text[0] == '"' and set(text[1:]) <= _BRACKETS:
                in_string.append(i)
            elif set(text) <= _BRACKETS:
                outside.append(i)
            elif set(text) <= _ENDING:
                ending.append(i)
            if not (piece.isascii() and piece.isprintable()) or '"' in piece or "\\" in piece or " " in piece:
                continue  # byte-level pieces of multi-byte characters would "move" into a partial character
            if all(not c.isalnum() and not c.isspace() for c in piece) and len(piece) <= 3:
                punctuation.append(i)
            elif len(piece) == 1 and piece.isprintable():
                characters.append(i)
        rank = np.full(vocab_size, len(punctuation) + len(characters), dtype=np.int64)
        rank[punctuation + characters] = np.arange(len(punctuation) + len(characters))
        return cls(
            bitmask_row(in_string, vocab_size),
            bitmask_row(outside, vocab_size),
            bitmask_row(ending, vocab_size),
            bitmask_row(punctuation + characters, vocab_size),
            rank,
            piece_length,
            {i: text for i in quoting if (text := _quoting(tokenizer.decode([i]))) != "x"},
            bitmask_row(list(singles.values()), vocab_size),
        )


def _quoting(text: str) -> str:
    """A text's quotes and backslashes, each run of other characters as one "x"."""
    return re.sub(r'[^"\\]+', "x", text)


def budget_reserve(max_tokens: int, required_names: int = 0) -> int:
    """How many tokens before ``max_tokens`` a JSON output starts closing: required properties
    still to come can take many (64 was too few for Github_medium o14497, 128 for o43230 with 23
    required names in its schema), so 8 more per required name, up to a third of the budget."""
    return min(128 + 8 * required_names, max_tokens // 3)


def count_required(schema: Any) -> int:
    """How many names the ``required`` lists of a JSON schema hold, all together."""
    if isinstance(schema, list):
        return sum(count_required(item) for item in schema)
    if not isinstance(schema, dict):
        return 0
    own = len(schema["required"]) if isinstance(schema.get("required"), list) else 0
    return own + sum(count_required(v) for k, v in schema.items() if k not in DATA_KEYWORDS)


class RepeatDetector:
    """Finds a cycle at the end of a token sequence, in O(MAX_PERIOD) per token (a C-level scan of
    the last tokens; Python work only for the periods at which the new token repeats). The
    fallback of ``NativeRepeatDetector``, and its reference.

    ``runs[p]`` counts how many of the latest tokens equal the token ``p`` places before them
    (periods with no such run are left out); the sequence ends in a cycle of period ``p`` once
    that count reaches ``max(2p, min_span)``.
    """

    def __init__(self, max_period: int = MAX_PERIOD, min_span: int = MIN_SPAN) -> None:
        self.max_period = max_period
        self.address = 0  # (no C state: ``NativeRepeatDetector``'s is its buffer's address)
        self.thresholds = [0] + [max(2 * p, min_span) for p in range(1, max_period + 1)]  # by period
        self.history: list[int] = []  # the last max_period tokens, newest last
        self.runs: dict[int, int] = {}
        self._places: dict[int, list[int]] = {}  # a token -> where it stands in ``history`` (counted by ``_added``)
        self._added = 0  # tokens recorded so far
        self.period = 0  # the shortest cycle's the sequence ends in (0: none)

    def add(self, token: int) -> bool:
        """Record a token; True if the sequence now ends in a cycle."""
        before, runs, thresholds = self.runs, {}, self.thresholds
        n, cycle = self._added, False
        places = self._places.get(token)
        if places is None:
            self._places[token] = [n]
        else:
            for place in places:  # the token n - place places back equals this one
                count = runs[n - place] = before.get(n - place, 0) + 1
                cycle = cycle or count >= thresholds[n - place]
            places.append(n)
        self.runs = runs
        self._added = n + 1
        self.period = min(p for p, count in runs.items() if count >= thresholds[p]) if cycle else 0
        history = self.history
        history.append(token)
        if len(history) > self.max_period:
            gone = history.pop(0)
            left = self._places[gone]
            del left[0]
            if not left:
                del self._places[gone]
        return cycle

    def state(self) -> tuple[list[int], dict[int, int], int]:
        return list(self.history), dict(self.runs), self.period

    def set_state(self, state: tuple[list[int], dict[int, int], int]) -> None:
        history, runs, self.period = state
        self.history, self.runs, self._added, self._places = list(history), dict(runs), len(history), {}
        for i, token in enumerate(self.history):
            self._places.setdefault(token, []).append(i)

    def cycle(self) -> list[int]:
        """The tokens of the shortest cycle the sequence ends in (empty if none)."""
        return self.history[-self.period :] if self.period else []


class NativeRepeatDetector:
    """``RepeatDetector`` in C (``repeats.c``): its state one buffer, a token one call. Used where
    ``repeats.c`` is built (``repeat_detector``); the tests hold it to the Python one."""

    def __init__(self, max_period: int = MAX_PERIOD, min_span: int = MIN_SPAN) -> None:
        lib = library()
        assert lib is not None and 1 <= max_period <= _NATIVE_MAX_PERIOD
        self.max_period = max_period
        self._buffer = bytearray(lib.repeats_bytes())
        struct.pack_into("4i", self._buffer, 0, 0, 0, max_period, min_span)
        self._view = ctypes.c_char.from_buffer(self._buffer)  # (held: the buffer keeps its place)
        self.address = ctypes.addressof(self._view)
        self._add = lib.repeats_add
        self.period = 0  # the shortest cycle's the sequence ends in (0: none)

    def add(self, token: int) -> bool:
        """Record a token; True if the sequence now ends in a cycle."""
        self.period = self._add(self.address, token)
        return self.period > 0

    def state(self) -> tuple[bytes, int]:
        return bytes(self._buffer), self.period

    def set_state(self, state: tuple[bytes, int]) -> None:
        self._buffer[:], self.period = state

    def cycle(self) -> list[int]:
        """The tokens of the shortest cycle the sequence ends in (empty if none)."""
        period = self.period
        if not period:
            return []
        head, _, periods, _ = struct.unpack_from("4i", self._buffer)
        history = struct.unpack_from(f"{periods}i", self._buffer, 16)  # (a ring: the next token at head)
        return [history[(head - period + i) % periods] for i in range(period)]


_NATIVE_MAX_PERIOD = 64  # repeats.c's REPEATS_MAX_PERIOD


def repeat_detector() -> RepeatDetector | NativeRepeatDetector:
    """A cycle detector: ``repeats.c``'s where it is built, else the Python one."""
    return NativeRepeatDetector() if library() is not None else RepeatDetector()


class EarlyCloser:
    """One JSON-guided request's closing state: the cycle detector, the tokens banned for the
    cycles met while closing, and whether the output is inside a string (scanned lazily from the
    text, only while closing)."""

    def __init__(self, schema: Callable[[], Any] | None = None, grammar: tuple[str, str | None] = ("", None)) -> None:
        self._schema_of = schema  # the request's JSON schema (None: any JSON), read at first need
        self.grammar = grammar  # (its kind, its schema's text): what its grammar is made of
        self._examples: list[str] | None = None  # closing's step 3 (``schema_examples``)
        self._required: int | None = None
        self.plan: list[int] = []  # an example's tokens still to write
        self.script: list[int] = []  # a dry run's tokens still to write (the budget leaves no choice)
        self.next_check = 0  # the output length at which the budget is next checked (``GrammarManager``)
        # the last budget check found no way to close within it: rows outside strings are narrowed
        # without the grammar's lookahead (its trial fills would buy nothing but cost a fill each)
        self.hopeless = False
        self.recheck = 0  # tokens from one check to the next while hopeless (doubling)
        self.detector = repeat_detector()
        self.tokens: list[int] = []
        self.closing = False
        self.reason = ""
        self.banned: frozenset[int] = frozenset()
        self._banned_words: Banned | None = None  # ``banned_words``, made at first need
        self._scanned = 0
        self._in_string = False
        self._escaped = False

    def add(self, token: int) -> None:
        self.added(token, self.detector.add(token))

    def added(self, token: int, repeats: bool) -> None:
        """``add`` once the cycle detector has the token (``repeats``: its answer), as
        ``ClosingStep.add_many`` gives it for a step's rows together."""
        self.tokens.append(token)
        if self.plan:
            self.plan = self.plan[1:] if self.plan[0] == token else []
        if self.script:
            self.script = self.script[1:] if self.script[0] == token else []
        if repeats:
            if not self.closing:
                self.closing, self.reason = True, "repeat"
            cycle = self.tokens[-self.detector.period :]  # (the detector's cycle(): it saw these tokens)
            if not self.banned.issuperset(cycle):  # (a cycle that goes on bans nothing new: its row stays)
                self.banned = self.banned | frozenset(cycle)
                self._banned_words = None

    def snapshot(self) -> tuple[Any, ...]:
        return (
            self.detector.state(),
            len(self.tokens),
            self.closing,
            self.reason,
            self.banned,
            list(self.plan),
            list(self.script),
            self._scanned,
            self._in_string,
            self._escaped,
        )

    def restore(self, state: tuple[Any, ...]) -> None:
        banned = self.banned
        (
            detected,
            num_tokens,
            self.closing,
            self.reason,
            self.banned,
            self.plan,
            self.script,
            self._scanned,
            self._in_string,
            self._escaped,
        ) = state
        self.detector.set_state(detected)
        if self.banned is not banned:
            self._banned_words = None
        del self.tokens[num_tokens:]

    def examples(self) -> list[str]:
        if self._examples is None:
            self._examples = schema_examples(self._schema_of()) if self._schema_of is not None else []
        return self._examples

    def reserve(self, max_tokens: int) -> int:
        """``budget_reserve`` for this request's schema."""
        if self._required is None:
            self._required = count_required(self._schema_of()) if self._schema_of is not None else 0
        return budget_reserve(max_tokens, self._required)

    def near_budget(self, script: Sequence[int] = ()) -> None:
        """Start closing; with ``script``, write exactly those tokens (a dry run of closing that
        just fits what is left of the budget)."""
        if not self.closing:
            self.closing, self.reason = True, "budget"
        self.script = list(script)

    def follow_script(self, row: np.ndarray) -> bool:
        """Narrow the row to the script's next token, if there is one and the grammar allows it
        (else the script is dropped)."""
        if not self.script:
            return False
        if not _allows(row, self.script[0]):
            self.script = []
            return False
        row[:] = bitmask_row(self.script[:1], len(row) * 32)
        return True

    def in_string(self, closing: ClosingTokens) -> bool:
        """Whether the output so far ends inside a JSON string (its new tokens scanned by their
        quotes and backslashes alone: ``ClosingTokens.quoting``)."""
        tokens, scanned, quoting = self.tokens, self._scanned, closing.quoting
        if scanned == len(tokens) - 1 and tokens[-1] not in quoting:  # (a step's one new token, mostly)
            self._scanned, self._escaped = scanned + 1, False
            return self._in_string
        for token in tokens[scanned:]:
            text = quoting.get(token)
            if text is None:  # neither: characters that end an escape
                self._escaped = False
                continue
            for ch in text:
                if self._escaped:
                    self._escaped = False
                elif self._in_string and ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = not self._in_string
        self._scanned = len(self.tokens)
        return self._in_string

    def restrict(self, row: np.ndarray, closing: ClosingTokens, grammar: GrammarView | None = None) -> bool:
        """Narrow a bitmask row, in place, to the first class of the module's list that it allows;
        False (the row untouched) if none."""
        inside = self.in_string(closing)
        tiers = closing.tiers_inside if inside else closing.tiers_outside
        if narrow_rows(row[None], _FIRST, tiers)[0] == NARROWED:
            return True
        vocab_size = len(closing.step_rank)
        if grammar is not None:
            target = tiers.union
            if inside and not self.plan and self.examples():
                self.plan = grammar.completion(self.examples(), target)
            if self.plan and _allows(row, self.plan[0]):
                row[:] = bitmask_row(self.plan[:1], vocab_size)
                return True
            candidates = allowed_ids(row & closing.steps)
            candidates = candidates[np.argsort(closing.step_rank[candidates], kind="stable")][:MAX_STEPS]
            reaching, moving = grammar.lookahead(candidates.tolist(), target)
            if reaching or moving:
                row[:] = bitmask_row(reaching or moving, vocab_size)
                return True
        return self.unbanned(row)

    def unbanned(self, row: np.ndarray) -> bool:
        """Narrow the row, in place, to its tokens but the banned ones (of the cycles the output
        repeated), where it allows any; False (the row untouched) if none or none is banned."""
        return bool(self.banned) and narrow_rows(row[None], _FIRST, _NO_TIERS, [self.banned_words()])[0] == UNBANNED

    def banned_words(self) -> Banned:
        """The banned tokens, as ``narrow_rows`` takes them (made once per change of the banned set)."""
        if self._banned_words is None:
            self._banned_words = Banned(self.banned)
        return self._banned_words


_FIRST = [0]  # (a row alone: ``narrow_rows(row[None], _FIRST, ...)``)
_NO_TIERS = Tiers([])


def _allows(row: np.ndarray, token: int) -> bool:
    """Whether a bitmask row allows ``token``."""
    return bool((int(row[token // 32]) >> (token % 32)) & 1)
