"""The scheduler's grammar across drafts (real backends, real tokenizer): one mask row per verified
position, equal to a fresh replay; the grammar rolled back after filling; after a rejection the
state equals a fresh replay of the accepted tokens; unchecked invalid drafts fail closed."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from guidespec.protocol import GuidedDecoding
from guidespec.scheduler.grammar import FillRow, GrammarManager, GrammarSettings

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def manager(request: pytest.FixtureRequest, real_model_dir: Path) -> Iterator[tuple[GrammarManager, Any]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    settings = GrammarSettings(real_model_dir, request.param, 49152, (2,), compile_timeout_s=60.0, max_rows=4)
    grammar = GrammarManager(settings, tokenizer)
    yield grammar, _Text(tokenizer, request.param)
    grammar.shutdown()


class _Text:
    """Encodes JSON text with the backend's separators (xgrammar ", " and ": ", llguidance compact)."""

    def __init__(self, tokenizer: Any, backend: str) -> None:
        self.tokenizer, self.spaced = tokenizer, backend == "xgrammar"

    def encode(self, text: str) -> list[int]:
        if self.spaced:
            text = text.replace('",', '", ').replace('":', '": ')
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _matcher(grammar: GrammarManager, request_id: str, tokens: list[int]) -> None:
    """A fresh request with SCHEMA whose grammar has accepted ``tokens``."""
    if not grammar.submit(request_id, GuidedDecoding(json_schema=SCHEMA, close_early=False)):
        _wait(grammar, request_id)
    for token in tokens:
        assert grammar.accept(request_id, token)


def _fresh_row(grammar: GrammarManager, tokens: list[int]) -> np.ndarray:
    _matcher(grammar, "fresh", tokens)
    row = grammar.fill([FillRow("fresh")])[0].copy()
    grammar.release("fresh")
    return row


def test_draft_rows_equal_fresh_replays_and_the_grammar_is_rolled_back(manager: tuple[GrammarManager, Any]) -> None:
    grammar, text = manager
    prefix = text.encode('{"name":"')
    drafts = text.encode('Ann","age":3')[:4]
    _matcher(grammar, "r", prefix)
    rows = grammar.fill([FillRow("r", drafts)]).copy()
    assert rows.shape[0] == 1 + len(drafts)
    for j in range(len(drafts) + 1):
        assert np.array_equal(rows[j], _fresh_row(grammar, prefix + drafts[:j])), f"row {j}"
    assert np.array_equal(grammar.fill([FillRow("r")])[0], rows[0])  # rolled back to the prefix
    # a draft step's mask (the draft model's loop): the same rows, one request-sequence at a time
    for j in range(len(drafts) + 1):
        assert np.array_equal(grammar.fill_after(["r"], [drafts[:j]])[0], rows[j]), f"draft step {j}"
    assert not grammar.fill_after(["r"], [[2]])[0].any()  # the stop token inside a string: refused, allows nothing
    assert np.array_equal(grammar.fill([FillRow("r")])[0], rows[0])
    # verification accepted two drafts and rejected the third: advance by exactly those two
    for token in drafts[:2]:
        assert grammar.accept("r", token)
    assert np.array_equal(grammar.fill([FillRow("r")])[0], _fresh_row(grammar, prefix + drafts[:2]))
    grammar.release("r")


class _Counted:
    """A backend's matcher, counting the tokens ``advance`` is given."""

    def __init__(self, matcher: Any) -> None:
        self.inner, self.advanced = matcher, 0

    def advance(self, tokens: list[int]) -> int:
        self.advanced += len(tokens)
        return int(self.inner.advance(tokens))

    def __getattr__(self, name: str) -> Any:  # (the backend's fill reads its own matcher from ``matcher``)
        return getattr(self.inner, name)


def test_draft_steps_walk_each_grammar_once_and_put_it_back(manager: tuple[GrammarManager, Any]) -> None:
    """A step's draft steps send each request its sequence one token longer each time: the rows
    equal those filled from the request's state each time, each token is walked once, a sequence
    that leaves the walk starts again, a refused token stays refused, and the grammar is back where
    it was after the walk (and before any other use)."""
    grammar, text = manager
    prefix = text.encode('{"name":"')
    document = text.encode('Ann","age":37}')
    other = text.encode('Bo","age":5')
    _matcher(grammar, "w", prefix)
    # ... then the stop token: it ends the grammar (xgrammar), or the grammar ended at "}" and
    # refuses it (llguidance)
    sequences = [document[:j] for j in range(len(document) + 1)] + [document + [2]] + [other[:j] for j in range(4)]
    reference = []
    for sequence in sequences:  # each from the request's state
        reference.append(grammar.fill_after(["w"], [sequence])[0].copy())
        grammar.end_draft_walk()
    assert _allowed(reference[len(document)], 2)
    after_stop = reference[len(document) + 1]
    assert np.array_equal(after_stop, grammar.stop_rows(1)[0]) or not after_stop.any()
    backend, matcher = grammar.matchers["w"]
    counted = _Counted(matcher)
    grammar.matchers["w"] = (backend, counted)  # type: ignore[assignment]
    for j, sequence in enumerate(sequences):
        assert np.array_equal(grammar.fill_after(["w"], [sequence])[0], reference[j]), f"sequence {j}"
    # the document walked once, the stop token once, then the other sequence from its start
    assert counted.advanced == len(document) + 1 + 3
    grammar.end_draft_walk()
    assert np.array_equal(grammar.fill([FillRow("w")])[0], reference[0])
    grammar.fill_after(["w"], [document[:3]])
    assert grammar.accept("w", document[0])  # (the walk ends first)
    assert np.array_equal(grammar.fill([FillRow("w")])[0], _fresh_row(grammar, prefix + document[:1]))
    grammar.release("w")


def test_advance_accepts_what_accept_token_would(manager: tuple[GrammarManager, Any]) -> None:
    grammar, text = manager
    _matcher(grammar, "a", text.encode('{"name":"'))
    matcher = grammar.matchers["a"][1]
    for tokens in (text.encode('Ann","age":3'), text.encode('Ann"}'), text.encode('A","age":1}') + [2, 2], []):
        one_by_one = 0
        for token in tokens:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            one_by_one += 1
        matcher.rollback(one_by_one)
        assert matcher.advance(tokens) == one_by_one, tokens
        matcher.rollback(one_by_one)
    assert not matcher.is_terminated()  # (every walk rolled back)
    grammar.release("a")


def test_an_unchecked_invalid_draft_is_refused_and_later_rows_allow_nothing(
    manager: tuple[GrammarManager, Any],
) -> None:
    grammar, text = manager
    prefix = text.encode('{"name":"Ann","age":')
    digit = text.encode("4")
    letter = text.encode("x")
    _matcher(grammar, "r", prefix)
    drafts = digit + letter + digit
    rows = grammar.fill([FillRow("r", drafts)]).copy()
    assert _allowed(rows[0], digit[0]) and not _allowed(rows[1], letter[0])  # the target's mask refuses "x"
    assert not rows[2].any() and not rows[3].any()  # after the refused draft: fail closed
    assert np.array_equal(grammar.fill([FillRow("r")])[0], rows[0])
    assert grammar.valid_prefix("r", [], drafts) == 1 and grammar.valid_prefix("r", digit, letter) == 0
    grammar.release("r")


def _allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def test_a_draft_that_ends_the_grammar_leaves_only_the_stop_token(manager: tuple[GrammarManager, Any]) -> None:
    grammar, text = manager
    assert grammar.submit("c", GuidedDecoding(choice=("yes", "no"))) or _wait(grammar, "c")
    yes = text.encode("yes")
    rows = grammar.fill([FillRow("c", yes + [2])]).copy()  # 2: the stop token
    assert _allowed(rows[1], 2)
    assert [t for t in range(49152) if _allowed(rows[2], t)] == [2]
    assert np.array_equal(grammar.fill([FillRow("c")])[0], rows[0])
    grammar.release("c")


def _wait(grammar: GrammarManager, request_id: str) -> bool:
    deadline = time.monotonic() + 60
    while request_id not in grammar.poll()[0]:
        assert time.monotonic() < deadline, "the grammar did not compile"
        time.sleep(0.01)
    return True


def test_forced_tokens_are_drafted_beyond_the_draft_length(manager: tuple[GrammarManager, Any]) -> None:
    """The grammar's forced tokens are certain, so they are drafted past ``max_draft_len`` (as
    jump-forward appends all of them for requests that do not speculate), up to what max_tokens
    leaves; they do not count toward the drafter's acceptance."""
    from guidespec.config import SpeculativeConfig
    from guidespec.protocol import SamplingParams
    from guidespec.scheduler.batching import ScheduledRow
    from guidespec.scheduler.request import Request
    from guidespec.scheduler.speculation.proposer import Speculator

    grammar, text = manager
    schema = {
        "type": "object",
        "properties": {"a_rather_long_property_name": {"type": "integer"}},
        "required": ["a_rather_long_property_name"],
        "additionalProperties": False,
    }
    speculator = Speculator(SpeculativeConfig(method="ngram", max_draft_len=3, adaptive=False), grammar, 4096)
    for max_tokens, expected_room in ((200, None), (4, 2)):
        spec = GuidedDecoding(json_schema=schema, close_early=False)
        prompt = text.encode("Write it.")
        request = Request(
            "f",
            prompt,
            SamplingParams(max_tokens=max_tokens, temperature=0.0, guided=spec),
            0.0,
        )
        assert grammar.submit("f", spec) or _wait(grammar, "f")
        request.output_token_ids = text.encode("{")
        assert grammar.accept("f", request.output_token_ids[0])
        request.num_computed_tokens = len(prompt)
        forced = grammar.forced_tokens("f", 16)
        assert len(forced) > 3, text.tokenizer.decode(forced)  # '"a_rather_long_property_name": '
        [row] = speculator.plan([ScheduledRow(request, len(prompt), 1, 1)], max_tokens_per_step=512)
        if expected_room is None:
            assert request.draft_tokens[: len(forced)] == forced and row.num_logits == 1 + len(request.draft_tokens)
        else:  # max_tokens 4 with one token out: room for 2 drafts (and the bonus token)
            assert request.draft_tokens == forced[:expected_room]
        speculator.observe(request, len(request.draft_tokens), len(request.draft_tokens))
        assert request.request_id not in speculator.acceptance  # forced drafts say nothing of the drafter
        grammar.release("f")


O30231 = {
    "type": "object",
    "title": "servicegroup_servicegroupmember_binding",
    "properties": {  # Github_medium, abridged
        "customserverid": {"type": "string"},
        "delay": {"type": "integer"},
        "graceful": {"enum": ["YES", "NO"], "type": "string"},
        "ip": {"type": "string"},
        "port": {"type": "integer"},
        "state": {"enum": ["ENABLED", "DISABLED"], "type": "string"},
        "svrstate": {"enum": ["UP", "DOWN", "OUT OF SERVICE", "GOING OUT OF SERVICE"], "type": "string"},
        "weight": {"type": "integer"},
    },
}


@pytest.mark.parametrize("schema", [SCHEMA, O30231], ids=["person", "o30231"])
def test_every_token_a_mask_row_allows_is_accepted(manager: tuple[GrammarManager, Any], schema: Any) -> None:
    """Masks and accepts agree through the scheduler's whole path: forced and n-gram-like drafts
    filled and rolled back, verification that accepts some and samples from the row where it
    stops, closing near a small budget. A random "model" picks any token its row allows, so every
    step's token must be accepted (the sampled sweep once failed a request with "the grammar
    rejected sampled token" on Github_medium o30231)."""
    grammar, _ = manager
    rng = np.random.default_rng(0)
    for episode in range(4):
        request_id, max_tokens = f"fuzz{episode}", 96
        assert grammar.submit(request_id, GuidedDecoding(json_schema=schema)) or _wait(grammar, request_id)
        output: list[int] = []
        finished = False
        while not finished and len(output) < max_tokens:
            drafts = grammar.forced_tokens(request_id, 6)
            if len(output) > 4:  # an n-gram-like proposal: a span of the output so far
                start = int(rng.integers(0, len(output)))
                drafts = drafts + output[start : start + int(rng.integers(1, 4))]
            rows = grammar.fill([FillRow(request_id, drafts, len(output), max_tokens)]).copy()
            step: list[int] = []
            for j in range(len(drafts) + 1):
                allowed = np.flatnonzero(np.unpackbits(rows[j].view(np.uint8), bitorder="little"))
                assert len(allowed), f"row {j} allows nothing"
                if j < len(drafts) and _allowed(rows[j], drafts[j]) and rng.random() < 0.8:
                    step.append(drafts[j])
                    continue
                step.append(int(rng.choice(allowed)))
                break
            for token in step:
                if token == 2:
                    finished = True
                    break
                assert grammar.accept(request_id, token), f"allowed token {token} rejected: {grammar.error(request_id)}"
                output.append(token)
                if grammar.is_terminated(request_id):
                    finished = True
                    break
        grammar.release(request_id)


def test_a_complete_output_offers_its_end_token_and_nothing_before(manager: tuple[GrammarManager, Any]) -> None:
    """Once the object is closed the grammar allows only the stop token: the scheduler ends the
    request there without a step (xgrammar; llguidance's matcher stops by itself there). Before
    that (inside, or where more may follow) there is none, and the check leaves the grammar as it
    was."""
    grammar, text = manager
    tokens = text.encode('{"name":"Ann","age":41}')
    _matcher(grammar, "r", [])
    for i, token in enumerate(tokens):
        assert grammar.end_token("r") is None, i
        assert grammar.accept("r", token)
    if grammar.is_terminated("r"):  # llguidance stops by itself here: the request ends at "}"
        assert not text.spaced
        assert grammar.end_token("r") is None
    else:
        assert grammar.end_token("r") == 2
        assert grammar.end_token("r") == 2 and not grammar.is_terminated("r")  # asking changed nothing
        assert grammar.end_tokens(["r"], [tokens[-1]]) == {"r": 2}  # its last token, tried again: refused
        assert grammar.accept("r", 2) and grammar.is_terminated("r")
        assert grammar.end_token("r") is None
    grammar.release("r")


def test_an_output_that_may_end_or_go_on_is_told_apart_without_a_fill(manager: tuple[GrammarManager, Any]) -> None:
    """A pattern's ``[a-z]+`` may end after each letter and go on: the end check finds that its
    last token is allowed again by a trial accept, and fills no row (the step's fill does, while
    the workers compute). Without that token, the check fills the row to know."""
    grammar, text = manager
    if not grammar.submit("p", GuidedDecoding(regex="[a-z]+")):
        _wait(grammar, "p")
    tokens = text.tokenizer.encode("abc", add_special_tokens=False)
    for token in tokens:
        assert grammar.accept("p", token)
    assert grammar.end_tokens(["p"], [tokens[-1]]) == {} and "p" not in grammar._filled
    assert grammar.end_tokens(["p"]) == {} and "p" in grammar._filled  # (kept for the next fill)
    assert grammar.accept("p", tokens[-1])  # the probe left the grammar where it was
    grammar.release("p")


def test_auto_sets_up_every_backend_it_may_fall_back_to_before_the_first_step(real_model_dir: Path) -> None:
    """llguidance's setup takes half a second: with "auto" it is made with the manager, so the
    first request xgrammar refuses does not wait for it mid-serving."""
    from transformers import AutoTokenizer

    settings = GrammarSettings(real_model_dir, "auto", 49152, (2,), compile_timeout_s=60.0, max_rows=4)
    grammar = GrammarManager(settings, AutoTokenizer.from_pretrained(real_model_dir))
    try:
        assert sorted(grammar.backends) == ["llguidance", "xgrammar"]
    finally:
        grammar.shutdown()


@pytest.mark.parametrize("recompile", ["never", "always"])
def test_a_grammar_compiled_again_or_carried_as_text_fills_the_same_rows(real_model_dir: Path, recompile: str) -> None:
    """xgrammar's compiled grammar comes back as text, or the scheduler compiles the spec again
    (where its text costs more than a compile); both serve the same masks."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    settings = GrammarSettings(
        real_model_dir, "xgrammar", 49152, (2,), compile_timeout_s=60.0, max_rows=4, recompile=recompile
    )
    grammar = GrammarManager(settings, tokenizer)
    reference = GrammarManager(dataclasses.replace(settings, recompile="never"), tokenizer)
    try:
        rows = []
        for manager in (grammar, reference):
            _matcher(manager, "r", _Text(tokenizer, "xgrammar").encode('{"name":"Al'))
            rows.append(manager.fill([FillRow("r")]).copy())
        np.testing.assert_array_equal(rows[0], rows[1])
        assert (grammar.compiler.recompiled, reference.compiler.recompiled) == (int(recompile == "always"), 0)
        assert 0 < int(np.unpackbits(rows[0].view(np.uint8)).sum()) < 49152
    finally:
        grammar.shutdown()
        reference.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_fills_on_several_threads_equal_fills_on_one(real_model_dir: Path, backend: str) -> None:
    """``grammar_fill_threads`` > 1 fills a step's rows on the backend's pool: the rows of twelve
    requests at different depths, with drafts, equal one thread's, and every grammar is left as
    it was."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    text = _Text(tokenizer, backend)
    settings = GrammarSettings(real_model_dir, backend, 49152, (2,), compile_timeout_s=60.0, max_rows=64)
    managers = [GrammarManager(dataclasses.replace(settings, fill_threads=n), tokenizer) for n in (1, 4)]
    document = text.encode('{"name":"Alice Smith","age":42}')
    try:
        filled = []
        for manager in managers:
            rows = []
            for i in range(12):
                _matcher(manager, f"r{i}", document[: i + 1])
                rows.append(FillRow(f"r{i}", document[i + 1 : i + 1 + i % 4]))
            filled.append(manager.fill(rows).copy())
            filled.append(
                manager.fill_after([f"r{i}" for i in range(12)], [document[i + 1 : i + 3] for i in range(12)]).copy()
            )
            filled.append(manager.fill(rows).copy())  # the drafts were rolled back
        for one, many in zip(filled[:3], filled[3:]):
            np.testing.assert_array_equal(one, many)
        np.testing.assert_array_equal(filled[0], filled[2])
        assert filled[0].shape[0] == sum(1 + len(r.drafts) for r in rows) > 24 and filled[0].any(axis=1).all()
    finally:
        for manager in managers:
            manager.shutdown()
