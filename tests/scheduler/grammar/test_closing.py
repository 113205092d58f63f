"""Early closing of JSON outputs: the cycle detector, the closing-token sets, the string scanner,
and the mask restriction never allowing a token the grammar refused."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guidespec.scheduler.grammar.closing import (
    ClosingTokens,
    EarlyCloser,
    NativeRepeatDetector,
    RepeatDetector,
    budget_reserve,
    count_required,
    schema_examples,
)
from guidespec.model_files import default_model_path, resolve_model_dir
from guidespec.scheduler.grammar.narrowing import library

DETECTORS = [  # (the C one where repeats.c is built, the Python one everywhere: its fallback)
    pytest.param(NativeRepeatDetector, id="c", marks=pytest.mark.skipif(library() is None, reason="no C compiler")),
    pytest.param(RepeatDetector, id="python"),
]


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(default_model_path()))


@pytest.fixture(scope="module")
def managers(tokenizer, real_model_dir):  # type: ignore[no-untyped-def]
    """One grammar manager (and compile process) per backend for the module's tests; each test's
    requests have ids of their own and are released at its end."""
    from guidespec.scheduler.grammar import GrammarManager, GrammarSettings

    made: dict[str, Any] = {}

    def manager(backend: str) -> Any:
        if backend not in made:
            made[backend] = GrammarManager(GrammarSettings(real_model_dir, backend, 49152, (2,), 60.0, 4), tokenizer)
        return made[backend]

    yield manager
    for grammar in made.values():
        grammar.shutdown()


@pytest.fixture(scope="module")
def quote_tokens(tokenizer) -> set[int]:  # type: ignore[no-untyped-def]
    """The tokens whose text has a double quote (a rambling model never writes one itself)."""
    return {t for t in range(len(tokenizer)) if '"' in tokenizer.decode([t])}


_request_ids = itertools.count()


def _compiled(grammar: Any, schema: Any) -> str:
    """A new request id with ``schema``'s grammar compiled and its matcher made in ``grammar``."""
    from guidespec.protocol import GuidedDecoding

    request_id = f"r{next(_request_ids)}"
    ready = grammar.submit(request_id, GuidedDecoding(json_schema=schema))
    deadline = time.monotonic() + 60
    while not ready:
        assert time.monotonic() < deadline, "the grammar did not compile"
        ready = request_id in grammar.poll()[0]
        time.sleep(0.01)
    return request_id


def _ids(mask: np.ndarray) -> list[int]:
    return np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0].tolist()


@pytest.mark.parametrize("detector_class", DETECTORS)
def test_detector_fires_on_a_cycle_and_not_on_varied_text(detector_class: Any) -> None:
    cycle = [5, 6, 7, 8]
    detector = detector_class()
    fired = [detector.add(t) for t in cycle * 10]
    # period 4: fires once 24 tokens (= max(2*4, 24)) equal the ones 4 places before them
    assert fired.index(True) == 4 + 24 - 1
    assert detector.cycle() == cycle  # (the last period's tokens)
    varied = detector_class()
    rng = np.random.default_rng(0)
    assert not any(varied.add(int(t)) for t in rng.integers(0, 1000, size=2000))
    long_period = detector_class()
    block = list(range(100, 130))  # period 30: needs 2 * 30 repeated tokens, three copies
    assert [long_period.add(t) for t in block * 3].index(True) == 89


def _ends_in_cycle(tokens: list[int], max_period: int = 32, min_span: int = 24) -> bool:
    """The detector's definition, from the whole sequence: for some period p, the last
    max(2p, min_span) tokens each equal the token p places before them."""
    for p in range(1, max_period + 1):
        span = max(2 * p, min_span)
        if len(tokens) >= span + p and all(tokens[-i] == tokens[-i - p] for i in range(1, span + 1)):
            return True
    return False


@pytest.mark.parametrize("detector_class", DETECTORS)
@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=120),
    st.lists(st.integers(0, 4), min_size=1, max_size=6),
    st.integers(0, 12),
    st.integers(0, 200),
)
def test_detector_matches_its_definition_through_snapshots(
    detector_class: Any, start: list[int], cycle: list[int], copies: int, saved_at: int
) -> None:
    """Token by token, on a few-token alphabet (runs at many periods at once) ending in copies of
    a cycle, and set back to a saved state once on the way (as a dry run or drafts do): it fires
    exactly where the sequence ends in a cycle by the definition, and its cycle is the last
    tokens of the shortest period that does."""
    tokens = start + cycle * copies + start[:3]
    detector = detector_class()
    saved, seen = None, []

    def add(token: int) -> None:
        seen.append(token)
        fired = detector.add(token)
        assert fired == _ends_in_cycle(seen)
        shortest = next((p for p in range(1, 33) if _ends_in_cycle(seen, max_period=p)), 0)
        assert detector.cycle() == (seen[-shortest:] if fired else [])

    for i, token in enumerate(tokens):
        if i == saved_at % len(tokens):
            saved = (detector.state(), list(seen))
        add(token)
    if saved is not None:
        detector.set_state(saved[0])
        seen = saved[1]
        for token in tokens[len(seen) :]:
            add(token)


@pytest.mark.parametrize("detector_class", DETECTORS)
def test_detector_resets_when_the_cycle_breaks(detector_class: Any) -> None:
    detector = detector_class()
    for t in [1, 2] * 12:
        detector.add(t)
    assert not detector.add(3)
    assert not any(detector.add(t) for t in [1, 2] * 5)


def test_closing_tokens_of_the_default_tokenizer(tokenizer) -> None:  # type: ignore[no-untyped-def]
    closing = ClosingTokens.from_tokenizer(tokenizer, 49152)
    in_string = {tokenizer.decode([i]) for i in _ids(closing.in_string)}
    outside = {tokenizer.decode([i]) for i in _ids(closing.outside)}
    assert {'"', '"]', '"}'} <= in_string and {"]", "}", "]}", "}}"} <= outside
    assert {",", "},", "],"} <= {tokenizer.decode([i]) for i in _ids(closing.ending)}
    steps = [tokenizer.decode([i]) for i in _ids(closing.steps)]
    assert {":", "://", "Z", "7", "-"} <= set(steps) and not any('"' in t or "\\" in t for t in steps)
    assert all(t.strip().startswith('"') for t in in_string)
    assert all(set(t.strip()) <= set("]}") for t in outside)


def test_string_scanner_follows_quotes_and_escapes(tokenizer) -> None:  # type: ignore[no-untyped-def]
    closing = ClosingTokens.from_tokenizer(tokenizer, 49152)
    closer = EarlyCloser()
    expected = [('{"a": ["wa\\"ter', True), ('", "x', True), ('"', False), (', "\\\\', True), ('"]}', False)]
    for text, inside in expected:
        for token in tokenizer.encode(text):
            closer.add(token)
        assert closer.in_string(closing) is inside, text


def test_restriction_keeps_only_allowed_closing_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    closing = ClosingTokens.from_tokenizer(tokenizer, 49152)
    closer = EarlyCloser()
    for token in tokenizer.encode('["water", "water"'):
        closer.add(token)
    close_bracket, comma = tokenizer.encode("]")[0], tokenizer.encode(",")[0]
    row = _row(close_bracket, comma)
    assert closer.restrict(row, closing)
    assert _ids(row) == [close_bracket]  # the grammar allowed both; closing keeps "]"
    comma_or_digit = _row(comma, tokenizer.encode("7")[0])
    assert closer.restrict(comma_or_digit, closing)  # no bracket allowed: the value ends
    assert _ids(comma_or_digit) == [comma]
    closer.add(tokenizer.encode(' "')[0])  # inside a string now: a comma is text, not an end
    letters = _row(*tokenizer.encode("abc"))
    before = letters.copy()
    assert not closer.restrict(letters, closing)  # nothing closing allowed: untouched
    assert (letters == before).all()


LOOPS = [  # (schema, text the output starts with, the tokens a looping model keeps writing)
    ({"type": "integer", "minimum": 0}, "1", ["0"]),
    (
        {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        '{"x": 1',
        ["0"],
    ),
    (
        {"type": "object", "patternProperties": {'^[a-zA-Z]+://[^ "]+$': {}}, "additionalProperties": False},
        '{"description',
        ["Type", "Info"],
    ),
    ({"type": "string", "pattern": ".*:.*"}, '"A', [".", "T", ".", "S", ".", "R"]),
    (
        {
            "type": "object",
            "properties": {"mac": {"type": "string", "pattern": "([0-9a-f][0-9a-f](:|-)){4}[0-9a-f]{2}"}},
            "required": ["mac"],
        },
        '{"mac": "1',
        ["2", "3", "4", "5", "6", "7", "8", "9", "0", "1"],
    ),
    ({"type": "string", "pattern": "^allow|deny$"}, '"', ["d", "re", "am", "p", "ick"]),  # o26627, sampled
]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize(
    "schema,start,loop",
    LOOPS,
    ids=["integer", "number-before-required", "key-pattern", "pattern", "unanchored-pattern", "alternatives"],
)
def test_a_looping_model_is_steered_to_a_valid_end(tokenizer, managers, backend, schema, start, loop) -> None:  # type: ignore[no-untyped-def]
    """A model that writes its cycle whenever the grammar allows it (and otherwise the
    highest-numbered token allowed) still ends with a valid document: closing finds the comma, the
    stop token, the pattern's ``://`` or ``:`` through the grammar's lookahead, a MAC address
    from the schema's pattern (Github_easy o40228 wrote digits until max_tokens)."""
    import json

    import jsonschema

    from guidespec.scheduler.grammar import FillRow

    grammar = managers(backend)
    r = _compiled(grammar, schema)
    try:
        output = list(tokenizer.encode(start if backend == "xgrammar" else start.replace(": ", ":")))
        for token in output:
            assert grammar.accept(r, token)
        cycle = [tokenizer.encode(t)[0] for t in loop]
        for step in range(300):
            allowed = set(_ids(grammar.fill([FillRow(r, output_len=len(output), max_tokens=4096)])[0]))
            wanted = cycle[step % len(cycle)]
            token = wanted if wanted in allowed else max(allowed)
            if token == 2:
                break
            assert grammar.accept(r, token)
            output.append(token)
        else:
            raise AssertionError(f"not closed in 300 tokens: {tokenizer.decode(output)[-200:]!r}")
        jsonschema.validate(json.loads(tokenizer.decode(output)), schema)
    finally:
        grammar.release(r)


def _deep_required_schema() -> dict:
    """Five required objects of five required strings (Github_hard o59999's shape, smaller): its
    shortest document takes ~150 tokens, more than ``budget_reserve`` keeps at max_tokens 400."""
    leaf = {
        "type": "object",
        "properties": {f"field{j}": {"type": "string"} for j in range(5)},
        "required": [f"field{j}" for j in range(5)],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {f"part{i}": leaf for i in range(5)},
        "required": [f"part{i}" for i in range(5)],
        "additionalProperties": False,
    }


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_deep_required_structure_closes_within_max_tokens(tokenizer, managers, quote_tokens, backend) -> None:  # type: ignore[no-untyped-def]
    """A model that rambles inside every string (random tokens, never a quote) still ends
    with a valid document before max_tokens: closing starts when the dry run of closing
    (``closing_length``) no longer fits in what is left, not at a fixed reserve (the sampled sweep
    cut Github_hard o59999 and o66712 at max_tokens)."""
    import json

    import jsonschema

    from guidespec.scheduler.grammar import FillRow

    schema, max_tokens = _deep_required_schema(), 400
    assert budget_reserve(max_tokens, count_required(schema)) == 133
    grammar = managers(backend)
    r = _compiled(grammar, schema)
    try:
        shortest = grammar.closing_length(r, max_tokens)
        assert shortest is not None and 140 < shortest < 260  # 25 names and values, 6 objects
        assert grammar.closing_length(r, 50) is None
        rng = np.random.default_rng(0)
        output: list[int] = []
        for _ in range(max_tokens):
            allowed = _ids(grammar.fill([FillRow(r, output_len=len(output), max_tokens=max_tokens)])[0])
            if 2 in allowed:
                break
            rambling = [t for t in allowed if t not in quote_tokens]  # never ends a string itself
            token = int(rng.choice(rambling or allowed))
            assert grammar.accept(r, token)
            output.append(token)
        else:
            raise AssertionError(f"cut at max_tokens: {tokenizer.decode(output)[-200:]!r}")
        document = json.loads(tokenizer.decode(output))
        jsonschema.validate(document, schema)
        assert len(document["part0"]["field0"]) > 20  # it rambled until the budget called for closing
        assert grammar.closing_reason(r) == "budget"
    finally:
        grammar.release(r)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("slack", [4, 60])
def test_a_budget_that_barely_fits_the_shortest_document_still_ends_valid(
    tokenizer, managers, quote_tokens, backend, slack
) -> None:  # type: ignore[no-untyped-def]
    """max_tokens only ``slack`` tokens above the dry run's length from the start: the rambling
    model closes at once, and once what is left only fits the dry run, the dry run itself is
    written (the sampled sweep's Github_hard o66712 needs 926 of its 1024 tokens with xgrammar's
    separators; the model's own closing ran past 1024). The same with the first budget check
    done ahead of the first fill (``GrammarManager.prepare``, as the scheduler does while a
    prompt's prefill runs): the same output."""
    import json

    import jsonschema

    from guidespec.protocol import GuidedDecoding
    from guidespec.scheduler.grammar import FillRow

    schema = _deep_required_schema()
    grammar = managers(backend)
    r, prepared = _compiled(grammar, schema), f"prepared{next(_request_ids)}"
    try:
        shortest = grammar.closing_length(r, 1000)
        run, ended = grammar.closing_run(r, 1000)
        assert ended and len(run) == shortest  # ends with the stop token, or where the grammar ends (llguidance)
        max_tokens = shortest + slack

        def ramble(request_id: str) -> list[int]:
            rng = np.random.default_rng(1)
            output: list[int] = []
            while True:
                assert len(output) < max_tokens, f"cut at max_tokens: {tokenizer.decode(output)[-200:]!r}"
                allowed = _ids(grammar.fill([FillRow(request_id, output_len=len(output), max_tokens=max_tokens)])[0])
                rambling = [t for t in allowed if t not in quote_tokens]
                token = int(rng.choice(rambling or allowed))
                if token == 2:
                    return output
                assert grammar.accept(request_id, token)
                output.append(token)
                if grammar.is_terminated(request_id):
                    return output

        output = ramble(r)
        jsonschema.validate(json.loads(tokenizer.decode(output)), schema)
        if slack == 4:  # written as the dry run found it
            assert output == [t for t in run if t != 2]
        assert grammar.submit(prepared, GuidedDecoding(json_schema=schema))  # compiled: ready at once
        grammar.prepare(prepared, max_tokens)
        closer = grammar.closing.closers[prepared]
        assert closer.script if slack == 4 else closer.next_check > 0  # checked before any fill
        assert ramble(prepared) == output
    finally:
        grammar.release(r)
        grammar.release(prepared)


def test_budget_reserve() -> None:
    assert budget_reserve(1024) == 128 and budget_reserve(40) == 13 and budget_reserve(1) == 0
    assert budget_reserve(1024, required_names=23) == 312 and budget_reserve(1024, required_names=125) == 341
    schema = {"required": ["a", "b"], "properties": {"a": {"required": ["c"]}, "d": {"const": {"required": ["x"]}}}}
    assert count_required(schema) == 3
    closer = EarlyCloser(lambda: schema)
    assert closer.reserve(1024) == 152 and EarlyCloser().reserve(1024) == 128


def _row(*tokens: int) -> np.ndarray:
    """A bitmask row allowing ``tokens``."""
    row = np.zeros(1536, dtype=np.int32)
    for token in tokens:
        row[token // 32] |= np.int32(1 << (token % 32)) if token % 32 != 31 else np.int32(-(1 << 31))
    return row


def test_schema_examples_come_from_patterns_and_formats() -> None:
    schema = {
        "properties": {
            "a": {"type": "string", "pattern": "^[a-z]+://[^ ]+$"},
            "b": {"type": "string", "format": "date-time"},
            "c": {"enum": [{"pattern": "not a schema"}]},
        },
        "patternProperties": {"^x-[0-9]{2}$": {}},
    }
    examples = schema_examples(schema)
    assert examples[:3] == ["a://!", 'a://"', "a://#"] and "x-00" in examples and "2020-01-01T00:00:00Z" in examples
    assert schema_examples({"pattern": "^allow|deny$"}) == ["allow", "deny"]  # Github_easy o26627, sampled
    assert "not a schema" not in " ".join(examples)


def test_a_budget_no_closing_fits_is_checked_less_often_and_rows_stay_valid(tokenizer, managers) -> None:  # type: ignore[no-untyped-def]
    """An array of at least 300 integers in 96 tokens cannot be closed: the first budget check
    finds that (one dry run, shared by the requests with that grammar and output so far), the
    next ones come 32, then 64 tokens on; the rows (outside strings) are narrowed without trial
    fills, and every token they allow is one the grammar accepts."""
    from guidespec.scheduler.grammar import FillRow

    schema, max_tokens = {"type": "array", "items": {"type": "integer"}, "minItems": 300}, 96
    grammar = managers("xgrammar")
    requests = [_compiled(grammar, schema) for _ in range(2)]
    try:
        rows = grammar.fill([FillRow(r, output_len=0, max_tokens=max_tokens) for r in requests])
        closers = [grammar.closing.closers[r] for r in requests]
        assert all(c.hopeless and c.closing and c.next_check == 32 for c in closers)
        shared = [key for key in grammar.closing._early_runs if key[1] == ("json_schema", json.dumps(schema))]
        assert len(shared) == 1  # (one dry run for both)
        rng = np.random.default_rng(1)
        for output_len in range(max_tokens - 1):
            allowed = _ids(rows[0])
            assert allowed and 2 not in allowed
            token = int(rng.choice(allowed))
            assert all(grammar.accept(r, token) for r in requests)
            rows = grammar.fill([FillRow(r, output_len=output_len + 1, max_tokens=max_tokens) for r in requests])
            assert (rows[0] == rows[1]).all()
        assert all(c.hopeless and c.next_check == 32 + 64 for c in closers)  # (checked at 0 and 32)
    finally:
        for r in requests:
            grammar.release(r)


def test_a_cycle_that_goes_on_keeps_its_banned_row() -> None:
    """An output that keeps repeating its cycle bans nothing new: the banned tokens' mask row is
    made once, not again at every token (it was, for every looping row of every step)."""
    from guidespec.scheduler.grammar.closing import EarlyCloser

    closer = EarlyCloser()
    for token in [5, 6, 7] * 12:  # (a run of 24 tokens equal to those a period before: a cycle)
        closer.add(token)
    assert closer.closing and closer.reason == "repeat" and closer.banned == {5, 6, 7}
    row = closer.banned_words()
    for token in [5, 6, 7] * 4:
        closer.add(token)
    assert closer.banned_words() is row
    for token in [9] * 30:  # a new cycle: its token joins the banned ones
        closer.add(token)
    assert closer.banned == {5, 6, 7, 9} and closer.banned_words() is not row


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
def test_a_row_allowing_two_one_character_tokens_forces_nothing(tokenizer, backend_name: str) -> None:  # type: ignore[no-untyped-def]
    """``forces_nothing`` lets closing skip asking the grammar for forced tokens: walked through
    real schemas' valid instances (JSONSchemaBench), every row it clears has none, and it clears
    over a quarter of them (xgrammar 42%, llguidance 66%); rows with forced tokens (names,
    separators) are met along the way."""
    from guidespec.bitmask import bitmask_width
    from guidespec.grammar_backends import create_backend
    from guidespec.protocol import GuidedDecoding
    from guidespec.scheduler.grammar.narrowing import forces_nothing
    from tests.grammar_backends.dataset import SEPARATORS, load_cases, order_like_schema

    closing = ClosingTokens.from_tokenizer(tokenizer, 49152, (2,))
    backend = create_backend(backend_name, tokenizer, 49152, (2,))
    row = np.zeros((1, bitmask_width(49152)), dtype=np.int32)
    item, key = SEPARATORS[backend_name]
    counts = {"rows": 0, "cleared": 0, "forced": 0}
    for _, case in load_cases(every=37)[:10]:
        instance = next((t["data"] for t in case["tests"] if t["valid"]), None)
        if instance is None:
            continue
        try:
            compiled = backend.compile(GuidedDecoding(json_schema=json.dumps(case["schema"])))
        except Exception:  # (a schema this backend refuses)
            continue
        text = json.dumps(order_like_schema(instance, case["schema"]), separators=(item, key))
        matcher = backend.create_matcher(compiled)
        for token in tokenizer.encode(text, add_special_tokens=False):
            backend.fill_bitmasks([matcher], row, [0])
            cleared = bool(forces_nothing(row, np.zeros(1, dtype=np.int64), closing.probe)[0])
            forced = matcher.forced_tokens(1)
            assert not (cleared and forced), (text, forced)
            counts["rows"] += 1
            counts["cleared"] += cleared
            counts["forced"] += bool(forced)
            if not matcher.accept_token(token):
                break  # (an instance the grammar writes otherwise: what was walked counts)
    assert counts["forced"] > 0 and counts["cleared"] > counts["rows"] // 4, counts


@settings(max_examples=40, deadline=None)
@given(
    streams=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=90), min_size=2, max_size=6),
    broken=st.integers(0, 5),
)
def test_a_steps_tokens_given_together_leave_each_closer_as_one_by_one(
    tokenizer, streams: list[list[int]], broken: int
) -> None:  # type: ignore[no-untyped-def]
    """``ClosingStep.add_many`` (a step's rows: the native cycle detectors in one C call) leaves
    every closer where ``add``, a token at a time, leaves its twin: the detector's period, the
    closing, its reason and banned tokens; a closer that raises fails its request alone."""
    from guidespec.scheduler.grammar.closing import EarlyCloser
    from guidespec.scheduler.grammar.closing_step import ClosingStep

    together, alone = ClosingStep(tokenizer, 100, (0,)), ClosingStep(tokenizer, 100, (0,))
    names = [f"r{i}" for i in range(len(streams))]
    for step in (together, alone):
        step.closers = {name: EarlyCloser() for name in names}
    broken_name = names[broken % len(names)]

    def fail(token: int, repeats: bool) -> None:
        raise RuntimeError("a closer's fault")

    together.closers[broken_name].added = fail  # type: ignore[method-assign]
    for depth in range(max(len(s) for s in streams)):
        live = [(name, s[depth]) for name, s in zip(names, streams) if depth < len(s)]
        failed = together.add_many([name for name, _ in live] + ["not tracked"], [t for _, t in live] + [7])
        assert set(failed) == ({broken_name} & {name for name, _ in live})
        for name, token in live:
            alone.add(name, token)
    for name in names:
        if name == broken_name:
            continue
        a, b = together.closers[name], alone.closers[name]
        assert (a.detector.period, a.closing, a.reason, a.banned, a.tokens) == (
            b.detector.period,
            b.closing,
            b.reason,
            b.banned,
            b.tokens,
        )
