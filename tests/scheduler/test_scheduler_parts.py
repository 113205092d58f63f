"""Scheduler pieces on their own: batching and slots, stop conditions; the client's text
(incremental detokenization, stop strings)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from guidespec.protocol import SamplingParams
from guidespec.scheduler.batching import Batcher
from guidespec.detokenizer import IncrementalDetokenizer
from guidespec.output_text import OutputText
from guidespec.scheduler.output import finish_output, process_new_token
from guidespec.scheduler.request import Request


class _CharTokenizer:
    """Token i is chr(i); enough to test the scheduler's text handling."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def _request(rid: str, prompt_len: int, **params: object) -> Request:
    prompt = list(range(65, 65 + prompt_len))
    return Request(rid, prompt, SamplingParams(**params), 0.0)


def test_admission_slots_and_chunked_prefill() -> None:
    batcher = Batcher(max_batch_size=2, max_num_batched_tokens=10)
    a, b, c = _request("a", 6), _request("b", 8), _request("c", 3)
    for r in (a, b, c):
        batcher.add(r)
    rows = batcher.schedule()
    assert [(r.request.request_id, r.num_new_tokens, r.num_logits) for r in rows] == [("a", 6, 1), ("b", 4, 0)]
    assert c.slot is None and batcher.num_free_slots == 0
    for row in rows:
        row.request.advance_computed(row.num_new_tokens)
    a.output_token_ids.append(70)
    rows = batcher.schedule()  # a decodes one token first, b's prompt continues after it
    assert [(r.request.request_id, r.start, r.num_new_tokens, r.num_logits) for r in rows] == [
        ("a", 6, 1, 1),
        ("b", 4, 4, 1),
    ]
    freed = a.slot
    batcher.remove(a)
    assert batcher.num_free_slots == 1 and a.slot is None
    rows = batcher.schedule()  # c takes the freed slot
    assert c.slot == freed and any(r.request is c for r in rows)


@pytest.mark.parametrize("late_masks", [True, False])
def test_a_prompt_is_prefilled_while_its_grammar_compiles(late_masks: bool) -> None:
    """A grammar that compiles does not hold its prompt back (a slot no ready request wants): the
    prompt is computed meanwhile, at once and its last token with logits whose mask comes late
    (``late_masks``), or without late masks after a grace and all but the last token, which runs
    once the grammar is ready. A last token whose mask came too late runs again once it is ready.
    Ready requests come first."""
    import time

    from guidespec.scheduler.batching import PREFILL_WHILE_COMPILING_S

    batcher = Batcher(max_batch_size=2, max_num_batched_tokens=64, late_masks=late_masks)
    compiling, ready, later = _request("compiling", 6), _request("ready", 3), _request("later", 4)
    compiling.grammar_ready, compiling.compiling_since = False, time.monotonic()
    batcher.add(compiling)
    if not late_masks:
        assert batcher.schedule() == [] and not batcher.has_runnable_work  # within the grace: it waits
        compiling.compiling_since -= PREFILL_WHILE_COMPILING_S
    assert batcher.has_runnable_work
    batcher.add(ready)
    rows = batcher.schedule()
    assert ready.slot is not None and compiling.slot is not None  # the ready one was admitted too
    assert sorted((r.request.request_id, r.start, r.num_new_tokens, r.num_logits) for r in rows) == [
        ("compiling", 0, 6, 1) if late_masks else ("compiling", 0, 5, 0),
        ("ready", 0, 3, 1),
    ]
    for row in rows:
        row.request.advance_computed(row.num_new_tokens - (row.request is compiling and late_masks))
    if late_masks:  # its mask came too late (the scheduler drops the token): the last token waits
        compiling.mask_came_late = True
    ready.output_token_ids.append(70)
    batcher.add(later)  # no slot left: it waits
    rows = batcher.schedule()
    assert [r.request.request_id for r in rows] == ["ready"] and later.slot is None
    rows[0].request.advance_computed(1)
    assert not batcher.has_runnable_work
    batcher.promote(compiling)  # compiled: its last prompt token, with logits
    assert batcher.has_runnable_work
    rows = batcher.schedule()
    assert ("compiling", 5, 1, 1) in [(r.request.request_id, r.start, r.num_new_tokens, r.num_logits) for r in rows]


def test_computed_tokens_never_exceed_known_tokens() -> None:
    r = _request("a", 3)
    r.advance_computed(3)
    with pytest.raises(AssertionError):
        r.advance_computed(1)


def test_stop_string_is_cut_and_never_streamed() -> None:
    text = OutputText(_CharTokenizer(), [65, 66], SamplingParams(stop=("XY",), max_tokens=50), (0,))
    streamed = ""
    for count, ch in enumerate("abXcXYz", start=1):
        new_text, kept = text.add([ord(ch)], finished=False)
        streamed += new_text
        if kept is not None:
            break
    assert kept == 1 and count == 6  # (the token that completes the stop string is the output's last)
    assert streamed == "abXc" and text.text == "abXc"


def test_a_stop_string_ends_a_delta_of_several_tokens_at_its_token() -> None:
    """A step's delta may bring several tokens (accepted drafts): the output keeps those up to
    the one that completes a stop string; EOS and stop token ids add no text."""
    params = SamplingParams(stop=("cd", "zz"), stop_token_ids=(7,), max_tokens=50)
    text = OutputText(_CharTokenizer(), [65], params, eos_token_ids=(0,))
    assert text.add([ord("a"), ord("b"), ord("c")], finished=False) == ("ab", None)  # ("c" held back)
    assert text.add([ord("d"), ord("e"), ord("f")], finished=False) == ("", 1)  # (the held "c" never goes out)
    assert text.text == "ab"
    text = OutputText(_CharTokenizer(), [65], params, eos_token_ids=(0,))
    assert text.add([ord("a"), ord("b"), 0], finished=True) == ("ab", None)
    text = OutputText(_CharTokenizer(), [65], SamplingParams(ignore_eos=True), eos_token_ids=(66,))
    assert text.add([ord("a"), 66], finished=True) == ("aB", None)  # (EOS ignored: it is text)


def test_eos_max_tokens_and_model_length() -> None:
    r = _request("a", 2, max_tokens=3)
    assert not process_new_token(r, ord("a"), (0,), 100).finished
    assert process_new_token(r, 0, (0,), 100).finish_reason == "stop"
    r = _request("b", 2, max_tokens=2)
    process_new_token(r, ord("a"), (0,), 100)
    assert process_new_token(r, ord("b"), (0,), 100).finish_reason == "length"
    r = _request("c", 4, max_tokens=50)
    assert process_new_token(r, ord("a"), (0,), max_model_len=5).finish_reason == "length"
    r = _request("d", 2, ignore_eos=True, max_tokens=5)
    assert not process_new_token(r, 0, (0,), 100).finished
    assert finish_output(r, "abort").finish_reason == "abort"


def test_detokenizer_handles_multibyte_characters(real_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model_dir)
    text = "Grüße aus Köln 🌍! 東京 is big."
    ids = tok.encode(text)
    prompt = tok.encode("Say:")
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_the_decode_stream_and_the_window_give_the_same_text(real_model_dir: Path) -> None:
    """A fast tokenizer detokenizes through ``tokenizers``' DecodeStream, any other through the
    decode window: the same pieces, special tokens skipped, a character split over tokens held
    back until it is whole."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model_dir)

    class DecodeOnly:  # what a tokenizer without a Rust backend offers
        decode = staticmethod(tok.decode)

    ids = tok.encode('{"city": "Kraków", "note": "雪 ☃"}') + [tok.eos_token_id] + tok.encode(" tail 🌍.")
    prompt = tok.encode("<|im_start|>assistant\n")
    stream, window = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(DecodeOnly(), prompt)
    assert stream._stream is not None and window._stream is None
    pieces = [stream.add(t) for t in ids]
    assert pieces == [window.add(t) for t in ids]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    # (an output that comes whole, in one decode: ``OutputText`` with no stop strings)
    for tokenizer in (tok, DecodeOnly()):
        assert IncrementalDetokenizer(tokenizer, prompt).whole(ids) == "".join(pieces)
        text = OutputText(tokenizer, prompt, SamplingParams(), eos_token_ids=(tok.eos_token_id,))
        assert text.add(ids, finished=True) == ("".join(pieces), None)
    stray = [i for i in range(100, 200) if tok.decode([i]) == "\ufffd"][:1]
    assert IncrementalDetokenizer(tok, prompt).whole(ids + stray) is None  # (``add`` holds it back)


def test_a_requests_error_never_overtakes_its_tokens(real_model_dir: Path) -> None:
    """The emit's deltas wait in the table's outbox until the step's bitmask is out
    (``RequestTable.send_outbox``): an error sent meanwhile (a grammar that failed in that fill)
    goes after them, so the client sees the request's tokens before its end."""
    import zmq
    from transformers import AutoTokenizer

    from guidespec.ipc.zmq_channel import Channel, new_ipc_endpoint
    from guidespec.protocol import GRAMMAR_FAILED, RequestOutput, RequestOutputs
    from guidespec.scheduler.grammar import GrammarManager, GrammarSettings
    from guidespec.scheduler.table import RequestTable

    ctx = zmq.Context()
    endpoint = new_ipc_endpoint("table-test")
    receiver = Channel(ctx, zmq.PULL, endpoint, bind=True)
    sender = Channel(ctx, zmq.PUSH, endpoint, bind=False)
    grammar = GrammarManager(
        GrammarSettings(real_model_dir, "xgrammar", 49152, (2,), 60.0, 4), AutoTokenizer.from_pretrained(real_model_dir)
    )
    try:
        table = RequestTable(Batcher(max_batch_size=2, max_num_batched_tokens=16), grammar, None, sender)
        a, b = _request("a", 3), _request("b", 3)
        for request in (a, b):
            table.add(request)
            table.outbox.append(process_new_token(request, 72, (), 64))  # (what the emit posts)
        table.grammar_failed(a, "xgrammar gave up: a test")  # (no backend left: it fails)
        table.send_outbox()  # nothing left to send
        messages = [receiver.recv(timeout_s=10.0) for _ in range(2)]
        assert receiver.recv(timeout_s=0.2) is None
    finally:
        grammar.shutdown()
        sender.close()
        receiver.close()
        ctx.term()
    deltas, error = messages
    assert isinstance(deltas, RequestOutputs) and [d.request_id for d in deltas.outputs] == ["a", "b"]
    assert [d.new_token_ids for d in deltas.outputs] == [[72], [72]]
    assert isinstance(error, RequestOutput) and error.request_id == "a" and error.error_code == GRAMMAR_FAILED
    assert set(table.requests) == {"b"}


def test_grammars_advanced_before_the_bitmask_take_each_token_once(real_model_dir: Path) -> None:
    """A step run ahead of the next has its rows' grammars advanced first (``advance_grammars``:
    the next bitmask waits for that alone), the rest of its emit after the bitmask: the emit
    then appends each token without asking the grammar again (asked twice, "a" would be refused
    by ``ab+`` and the request fail), and a row whose token is dropped (sampled without its mask)
    leaves its grammar where it stood."""
    import time
    from types import SimpleNamespace

    import numpy as np
    import zmq
    from transformers import AutoTokenizer

    from guidespec.bitmask import allowed_ids
    from guidespec.ipc.zmq_channel import Channel, new_ipc_endpoint
    from guidespec.protocol import GuidedDecoding, StepOutputs
    from guidespec.scheduler.batching import ScheduledRow
    from guidespec.scheduler.emit import Emitter
    from guidespec.scheduler.grammar import FillRow, GrammarManager, GrammarSettings
    from guidespec.scheduler.table import RequestTable

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    a, b = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")
    ctx = zmq.Context()
    endpoint = new_ipc_endpoint("emit-test")
    receiver = Channel(ctx, zmq.PULL, endpoint, bind=True)
    sender = Channel(ctx, zmq.PUSH, endpoint, bind=False)
    grammar = GrammarManager(GrammarSettings(real_model_dir, "xgrammar", 49152, (2,), 60.0, 4), tokenizer)
    try:
        guided = GuidedDecoding(regex="ab+")
        table = RequestTable(Batcher(max_batch_size=2, max_num_batched_tokens=16), grammar, None, sender)
        requests = [_request(rid, 3, guided=guided, max_tokens=8) for rid in ("kept", "dropped")]
        for request in requests:
            table.add(request)
            request.num_computed_tokens = 3  # (the step went out: ``Batcher.started``)
            if not grammar.submit(request.request_id, guided):
                deadline = time.monotonic() + 60
                while request.request_id not in grammar.poll()[0]:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
        cfg = SimpleNamespace(max_model_len=64, jump_forward="off", eos_token_ids=(2,))
        emitter = Emitter(cfg, grammar, None, table)  # type: ignore[arg-type]
        rows = [ScheduledRow(request, 2, 1, 1) for request in requests]
        outputs = StepOutputs(1, np.array([a, a], np.int32), np.ones(2, np.int32))

        def allows(request_id: str) -> set[int]:
            mask = grammar.fill([FillRow(request_id, [], 1, 8)])
            return set(allowed_ids(mask[0], 49152).tolist()) & {a, b}

        emitter.advance_grammars(rows, outputs, {"dropped"})
        assert allows("kept") == {b} and allows("dropped") == {a}
        emitter.emit(rows, outputs, {"dropped"})
        kept, dropped = requests
        assert table.holds(kept) and kept.output_token_ids == [a] and kept.advanced is None
        assert allows("kept") == {b} and allows("dropped") == {a} and dropped.output_token_ids == []
    finally:
        grammar.shutdown()
        sender.close()
        receiver.close()
        ctx.term()


@pytest.mark.parametrize("stream", [True, False])
@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["text", "stray", "special", "split"]), st.integers(0, 60)),
        min_size=1,
        max_size=8,
    )
)
@example(parts=[("stray", 16), ("special", 13), ("stray", 1)])  # a character's bytes on both sides of the specials
@example(parts=[("stray", 20), ("special", 40), ("split", 1)])
def test_stray_bytes_neither_grow_the_window_nor_change_the_text(
    real_model_dir: Path, stream: bool, parts: list[tuple[str, int]]
) -> None:
    """An output with runs of tokens that never complete a character (stray UTF-8 bytes), of
    skipped special tokens and of characters split over tokens, ending in text: the same text
    as one decode of it all, while the window of tokens decoded at each step stays short (it
    grew with every token held back: 0.5 ms a token by the 1,500th)."""
    tok = _tokenizer(real_model_dir)
    stray = [i for i in range(100, 200) if tok.decode([i]) == "\ufffd"]
    split = tok.encode("🌍東")  # (bytes over several tokens)
    ids: list[int] = []
    for kind, n in parts:
        if kind == "text":
            ids += tok.encode(" wörd" * (n % 5 + 1))
        elif kind == "stray":
            ids += [stray[(n + k) % len(stray)] for k in range(n)]
        elif kind == "special":
            ids += [tok.eos_token_id] * n
        else:
            ids += split * (n % 3 + 1)
    ids += tok.encode(" end.")

    class DecodeOnly:  # what a tokenizer without a Rust backend offers
        decode = staticmethod(tok.decode)
        all_special_ids = tok.all_special_ids

    detok = IncrementalDetokenizer(tok if stream else DecodeOnly(), tok.encode("Say:"))
    pieces = []
    for token in ids:
        pieces.append(detok.add(token))
        held = detok._held if detok._stream is not None else len(detok.ids) - detok.read_offset
        assert held <= 32 and (detok._stream is not None or len(detok.ids) - detok.prefix_offset <= 64)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    # an output that comes whole is decoded at once only where that is the same text
    whole = IncrementalDetokenizer(tok if stream else DecodeOnly(), tok.encode("Say:")).whole(ids)
    assert whole is None or whole == "".join(pieces)


_TOKENIZERS: dict[Path, Any] = {}


def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
    return _TOKENIZERS[path]


def test_an_engine_keeps_a_step_trace_only_where_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without ``GUIDESPEC_TRACE`` the scheduler keeps no trace: one kept every step's spans
    until the engine stopped (a server's memory grew with every step). With it, every step's."""
    import numpy as np

    from guidespec.scheduler.trace import step_trace

    monkeypatch.delenv("GUIDESPEC_TRACE", raising=False)
    assert step_trace() is None
    monkeypatch.setenv("GUIDESPEC_TRACE", str(tmp_path / "trace.json"))
    trace = step_trace()
    assert trace is not None
    times = {"start": 0.0, "inputs": 0.1, "mask_start": 0.1, "mask": 0.2, "outputs": 0.5, "advanced": 0.6}
    for step in range(3):
        trace.record(step, {**times, "emit_start": 0.6, "end": 0.7}, np.array([0.1, 0.4, 0.4, 0.5]), 1, 0)
    assert trace.steps == 3 and len(trace.events) == 3 * 6  # (an unguided step: six spans)
