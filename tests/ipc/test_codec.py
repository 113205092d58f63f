"""Round trips of every wire message, and malformed frames rejected with an error."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from guidespec import protocol
from guidespec.ipc import codec

I32 = np.array([3, 1, 4], dtype=np.int32)
EXAMPLES = [
    protocol.SamplingParams(
        max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=11, stop=("x",), stop_token_ids=(2,)
    ),
    protocol.GenerateRequest("r1", I32, protocol.SamplingParams(), 1.5),
    protocol.GuidedDecoding(json_schema='{"type": "object"}', backend="llguidance"),
    protocol.SamplingParams(guided=protocol.GuidedDecoding(choice=("yes", "no"))),
    protocol.AbortRequest("r1"),
    protocol.Shutdown("bye"),
    protocol.EngineReady(2, 16, 2048),
    protocol.SchedulerStats(running=3, waiting=2, waiting_for_grammar=1, free_slots=13),
    protocol.RequestOutput("r1", [1, 2], True, "stop", None, 5, 2.0),
    protocol.RequestOutput("r2", [3], stats=protocol.DecodeStats(4, 2, 6, 3, [0, 1, 1]), restarted=True),
    protocol.RequestOutputs([protocol.RequestOutput("r1", [1, 2]), protocol.RequestOutput("r3", [], True, "length")]),
    protocol.DecodeStats(1, 0, 0, 0, []),
    protocol.EngineDead("worker rank 1 died"),
    protocol.StepInputs(
        3,
        I32,
        I32,
        I32,
        np.arange(10, dtype=np.int32),
        I32,
        np.ones(3, np.float32),
        I32,
        np.ones(3, np.float32),
        np.array([-1, 5, 6], np.int64),
        I32,
        I32,
        np.ones((3, 3), np.float32),
        True,
    ),
    protocol.StepNext(4),
    protocol.StepNext(5, I32, True, np.array([1], np.int32), np.array([2], np.int32), np.array([7, 8], np.int32)),
    protocol.StepNext(6, None, False, None, None, None, np.array([0, 2], np.int32)),
    protocol.StepBitmask(3, np.array([0, 2], np.int32), np.arange(8, dtype=np.int32).reshape(2, 4)),
    protocol.StepOutputs(3, I32, np.ones(3, np.int32), 0.25, np.arange(4, dtype=np.float64)),
    protocol.StepOutputs(4, I32, np.ones(3, np.int32), 0.1, None, I32, np.ones(3, np.int32)),
    protocol.DraftTokens(5, 1, np.array([0, 2], np.int32), I32, np.array([1, 2], np.int32)),
    protocol.DraftMask(5, 1, np.zeros((2, 4), np.int32)),
    protocol.MaskWanted(5),
    protocol.WorkerReady(1, 1234),
    protocol.WorkerError(1, "boom", 3),
]


def _equal(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message: object) -> None:
    assert _equal(codec.decode(codec.encode(message)), message)


def test_every_registered_message_has_an_example() -> None:
    assert set(codec._TAG_TO_CLASS.values()) == {type(m) for m in EXAMPLES}


def test_arrays_decode_without_copy() -> None:
    frame = bytearray(codec.encode(protocol.StepBitmask(1, I32, np.zeros((4, 1000), np.int32))))
    decoded = codec.decode(frame)
    assert np.shares_memory(decoded.bitmask, np.frombuffer(frame, dtype=np.uint8))


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\x01",
        b"\xff\xff\xff\x7f" + b"x",
        b"\x03\x00\x00\x00abc",
        codec._HEADER_LEN.pack(1) + msgpack.packb(5)[:1],
        codec._HEADER_LEN.pack(len(msgpack.packb({"a": 1}))) + msgpack.packb({"a": 1}),
    ],
    ids=["empty", "short", "bad-length", "garbage", "not-a-message", "plain-map"],
)
def test_malformed_frames_raise(frame: bytes) -> None:
    with pytest.raises(codec.MalformedMessage):
        codec.decode(frame)


def _frame_with_ext(code: int, payload: bytes) -> bytes:
    header = msgpack.packb(msgpack.ExtType(code, payload))
    return codec._HEADER_LEN.pack(len(header)) + header


def test_unknown_tag_and_wrong_arity_raise() -> None:
    with pytest.raises(codec.MalformedMessage, match="unknown message tag"):
        codec.decode(_frame_with_ext(2, msgpack.packb([999, []])))
    with pytest.raises(codec.MalformedMessage, match="fields"):
        codec.decode(_frame_with_ext(2, msgpack.packb([11, ["a", "b"]])))
    with pytest.raises(codec.MalformedMessage, match="unknown extension"):
        codec.decode(_frame_with_ext(9, b""))


def test_array_out_of_frame_bounds_raises() -> None:
    frame = codec.encode(protocol.StepOutputs(1, I32, I32, 0.0))
    codec.decode(frame)  # (its arrays' headers read once: the next frame repeats them, cut short)
    with pytest.raises(codec.MalformedMessage, match="does not fit"):
        codec.decode(frame[:-16])
    bad_dtype = _frame_with_ext(2, msgpack.packb([24, [1, msgpack.ExtType(1, msgpack.packb(["object", [1], 0, 8]))]]))
    with pytest.raises(codec.MalformedMessage):
        codec.decode(bad_dtype)


def test_refuses_to_encode_unregistered_objects() -> None:
    with pytest.raises(TypeError):
        codec.encode({"a": 1})
    with pytest.raises(TypeError):
        codec.encode(protocol.AbortRequest(object()))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        codec.encode(protocol.StepOutputs(1, np.array([object()]), I32, 0.0))


def test_a_step_next_stands_for_the_step_befores_rows_one_position_on() -> None:
    """``next_inputs``: a StepNext's StepInputs is the one before's with each row one position
    and one sample on, its own tokens (LAST_SAMPLED where it sends none), bitmask flag and table
    updates, through the codec as the workers get them; tokens for another batch are refused."""
    ones = np.ones(3, np.int32)
    before = protocol.StepInputs(
        7, np.array([4, 0, 2], np.int32), np.array([10, 30, 20], np.int32), ones, np.array([5, 6, 7], np.int32),
        ones, np.zeros(3, np.float32), ones * 0, np.ones(3, np.float32), np.array([-1, 5, -1], np.int64),
        np.array([2, 0, 9], np.int32), np.array([8, 28, 18], np.int32),
        np.tile(np.array([1.0, 0, 0], np.float32), (3, 1)),
    )  # fmt: skip
    before = codec.decode(codec.encode(before))
    assert protocol.follows_as_next(before)
    derived = protocol.next_inputs(before, codec.decode(codec.encode(protocol.StepNext(8))))
    expected = dataclasses.replace(
        before,
        step=8,
        start_positions=np.array([11, 31, 21], np.int32),
        token_ids=np.full(3, protocol.LAST_SAMPLED, np.int32),
        sample_index=np.array([3, 1, 10], np.int32),
    )
    assert _equal(derived, expected)
    assert not derived.penalized.any()
    tables = (np.array([0], np.int32), np.array([2], np.int32), np.array([3, 9], np.int32))
    message = codec.decode(codec.encode(protocol.StepNext(9, np.array([1, 2, 3], np.int32), True, *tables)))
    again = protocol.next_inputs(derived, message)
    assert _equal(
        again,
        dataclasses.replace(
            expected,
            step=9,
            start_positions=np.array([12, 32, 22], np.int32),
            token_ids=np.array([1, 2, 3], np.int32),
            sample_index=np.array([4, 2, 11], np.int32),
            has_bitmask=True,
            table_slots=tables[0],
            table_lens=tables[1],
            table_blocks=tables[2],
        ),
    )
    with pytest.raises(ValueError, match="2 tokens for 3 rows"):
        protocol.next_inputs(again, protocol.StepNext(10, np.array([1, 2], np.int32)))
    # a request that ended drops out: the rows kept, in order, each one on
    kept = protocol.next_inputs(
        again, codec.decode(codec.encode(protocol.StepNext(10, keep=np.array([0, 2], np.int32))))
    )
    rows = np.array([0, 2])
    assert _equal(
        kept,
        dataclasses.replace(
            again,
            step=10,
            slots=again.slots[rows],
            start_positions=np.array([13, 23], np.int32),
            num_new_tokens=again.num_new_tokens[rows],
            token_ids=np.full(2, protocol.LAST_SAMPLED, np.int32),
            num_logits=again.num_logits[rows],
            temperature=again.temperature[rows],
            top_k=again.top_k[rows],
            top_p=again.top_p[rows],
            seeds=np.array([-1, -1], np.int64),
            sample_index=np.array([5, 12], np.int32),
            num_prompt_tokens=np.array([8, 18], np.int32),
            penalties=again.penalties[rows],
            has_bitmask=False,
            table_slots=None,
            table_lens=None,
            table_blocks=None,
        ),
    )
    assert kept.penalized.shape == (2,) and protocol.follows_as_next(kept)
    for bad in ([2, 0], [], [0, 3], [1, 1]):
        with pytest.raises(ValueError, match="rows to keep"):
            protocol.next_inputs(again, protocol.StepNext(11, keep=np.array(bad, np.int32)))
    prefill = dataclasses.replace(before, num_new_tokens=np.array([1, 4, 1], np.int32))
    assert not protocol.follows_as_next(prefill)
