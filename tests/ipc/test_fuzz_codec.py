"""Fuzzing the msgpack codec and the ZeroMQ channel that decodes frames (issue 21: nothing a
client sends can hurt the engine).

Every frame, however made, must decode to a registered message whose fields have the types
their annotations name, or raise ``MalformedMessage``: no other exception, no crash, no hang,
no allocation out of proportion to the frame. Fuzzed, with hypothesis, every test under
``@seed(21)`` (the issue's number) with no example database, so every run draws the same cases:

- round trips: every registered message, its fields drawn from their annotations, encodes and
  decodes equal (300 examples);
- mutated valid frames: 0 to 8 bit flips anywhere, then 0 to 64 appended bytes (300
  examples); every truncation of a valid frame, each length from 0 to the frame's (100 frames,
  about 13,000 truncations);
- random bytes (0 to 512) as a frame, as they are and behind a correct header length (200
  examples, each decoded both ways);
- structured garbage: msgpack trees holding message extensions (registered tags with the right
  number of random fields, or any tag) and array extensions with random headers (dtype, shape,
  offset, size around the limits), then random payload bytes (400 examples);
- ``Channel.recv`` over ZeroMQ: 1 to 4 fuzzed frames are dropped and counted, the next good
  message comes through (40 examples); a trickle of garbage does not restart its timeout.

Plus fixed cases: fields of the wrong type; hostile headers (lengths of 2**32 for msgpack
arrays, maps, strings, binaries and extensions and for a message's fields, a 4 GB header
length, msgpack nesting 100,000 deep, arrays claiming 2**40 elements, a shape whose product
wraps int64, 1,000 dimensions, offsets out of range, a dtype not allowed), each refused within
1 s with a ``tracemalloc`` peak under 1 MB; and messages nested 10,000 deep (a few hundred
overflowed the C stack and killed the process: run in a subprocess). About 4 s in all.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
import tracemalloc
import types
import typing
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from guidespec import protocol  # noqa: F401  (registers the messages)
from guidespec.ipc import codec
from guidespec.ipc.zmq_channel import Channel, new_ipc_endpoint

SEED = 21


def fuzz(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


HEADER = codec._HEADER_LEN
MESSAGE_CLASSES = sorted(codec._CLASS_TO_TAG, key=lambda cls: codec._CLASS_TO_TAG[cls])
TAGS = sorted(codec._TAG_TO_CLASS)
EDGE_INTS = [0, 1, 2, 7, 8, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63)]


# ---------------------------------------------------------------- strategies


def message_strategy(cls: type) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, *[field_strategy(hints[f.name]) for f in dataclasses.fields(cls)])


def field_strategy(hint: Any) -> st.SearchStrategy[Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return st.one_of(*[field_strategy(h) for h in args])
    if origin is list:
        return st.lists(field_strategy(args[0]), max_size=4)
    if origin is tuple and args[-1:] == (Ellipsis,):
        return st.lists(field_strategy(args[0]), max_size=4).map(tuple)
    simple: dict[Any, st.SearchStrategy[Any]] = {
        type(None): st.none(),
        bool: st.booleans(),
        int: st.integers(-(2**63), 2**64 - 1),
        float: st.floats(),
        str: st.text(max_size=12),
        np.ndarray: arrays(),
    }
    if hint in simple:
        return simple[hint]
    if hint in codec._CLASS_TO_TAG:
        return message_strategy(hint)
    raise NotImplementedError(f"no strategy for a field of type {hint}: add one")


def arrays() -> st.SearchStrategy[np.ndarray]:
    shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
    return hnp.arrays(st.sampled_from(sorted(codec._ALLOWED_DTYPES)), shapes)


MESSAGES = st.sampled_from(MESSAGE_CLASSES).flatmap(message_strategy)
FRAMES = MESSAGES.map(codec.encode)


def garbage_trees() -> st.SearchStrategy[Any]:
    """msgpack values with message and array extensions, made to reach past the first checks."""
    leaves = (
        st.none()
        | st.booleans()
        | st.sampled_from(EDGE_INTS)
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=8)
        | st.binary(max_size=8)
    )

    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        well_sized = st.sampled_from(TAGS).flatmap(
            lambda tag: st.tuples(
                st.just(tag), st.lists(children, min_size=_num_fields(tag), max_size=_num_fields(tag))
            )
        )
        any_sized = st.tuples(st.sampled_from(TAGS) | st.sampled_from(EDGE_INTS), st.lists(children, max_size=4))
        message = (well_sized | any_sized).map(lambda item: msgpack.ExtType(2, msgpack.packb(list(item))))
        dims = st.sampled_from(EDGE_INTS) | st.integers(0, 6)
        array_header = st.tuples(
            st.sampled_from(sorted(codec._ALLOWED_DTYPES)) | children, st.lists(dims, max_size=4) | children, dims, dims
        )
        array = array_header.map(lambda header: msgpack.ExtType(1, msgpack.packb(list(header))))
        other_ext = st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))
        return (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=4), children, max_size=3)
            | message
            | array
            | other_ext
        )

    return st.recursive(leaves, extend, max_leaves=24)


def _num_fields(tag: int) -> int:
    return len(dataclasses.fields(codec._TAG_TO_CLASS[tag]))


def frame_of(header: bytes, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(header)) + header + b"\0" * (-(HEADER.size + len(header)) % 8) + payload


# ---------------------------------------------------------------- checks


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):
        return all(equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    return bool(a == b)


def fits(value: Any, hint: Any) -> bool:
    """The test's own reading of an annotation (tuple fields may hold lists: msgpack has no tuples)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return any(fits(value, h) for h in args)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(fits(v, args[0]) for v in value)
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, hint)


def assert_decodes_or_refuses(frame: bytes) -> None:
    """A registered message with fields of their declared types, or MalformedMessage; nothing else."""
    try:
        message = codec.decode(frame)
    except codec.MalformedMessage:
        return
    assert type(message) in codec._CLASS_TO_TAG
    hints = typing.get_type_hints(type(message))
    for f in dataclasses.fields(message):
        assert fits(getattr(message, f.name), hints[f.name]), (type(message).__name__, f.name)


# ---------------------------------------------------------------- round trips and mutations


def test_every_registered_message_has_a_strategy() -> None:
    for cls in MESSAGE_CLASSES:
        message_strategy(cls).validate()


@seed(SEED)
@fuzz(300)
@given(MESSAGES)
def test_every_message_round_trips(message: Any) -> None:
    assert equal(codec.decode(codec.encode(message)), message)


@seed(SEED)
@fuzz(300)
@given(FRAMES, st.lists(st.integers(0, 2**20), max_size=8), st.binary(max_size=64))
def test_bit_flipped_and_extended_frames_decode_or_refuse(frame: bytes, flips: list[int], tail: bytes) -> None:
    mutated = bytearray(frame)
    for flip in flips:
        mutated[flip // 8 % len(mutated)] ^= 1 << flip % 8
    assert_decodes_or_refuses(bytes(mutated) + tail)


@seed(SEED)
@fuzz(100)
@given(FRAMES)
def test_every_truncation_decodes_or_refuses(frame: bytes) -> None:
    for length in range(len(frame)):
        assert_decodes_or_refuses(frame[:length])


@seed(SEED)
@fuzz(200)
@given(st.binary(max_size=512))
def test_random_bytes_decode_or_refuse(data: bytes) -> None:
    assert_decodes_or_refuses(data)
    assert_decodes_or_refuses(frame_of(data))


@seed(SEED)
@fuzz(400)
@given(garbage_trees(), st.binary(max_size=96))
def test_structured_garbage_decodes_or_refuses(tree: Any, payload: bytes) -> None:
    assert_decodes_or_refuses(frame_of(msgpack.packb(tree), payload))


# ---------------------------------------------------------------- hostile headers


def _array_frame(dtype: Any, shape: Any, offset: Any, nbytes: Any) -> bytes:
    array = msgpack.ExtType(1, msgpack.packb([dtype, shape, offset, nbytes]))
    return frame_of(
        msgpack.packb(msgpack.ExtType(2, msgpack.packb([22, [1, array, array, 0.0, None, None, None, 0.0]]))),
        b"\0" * 64,
    )


HOSTILE = {
    "array32-len-2**32": frame_of(b"\xdd\xff\xff\xff\xff"),
    "map32-len-2**32": frame_of(b"\xdf\xff\xff\xff\xff"),
    "str32-len-2**32": frame_of(b"\xdb\xff\xff\xff\xff"),
    "bin32-len-2**32": frame_of(b"\xc6\xff\xff\xff\xff"),
    "ext32-len-2**32": frame_of(b"\xc9\xff\xff\xff\xff\x02"),
    "message-fields-2**32": frame_of(msgpack.packb(msgpack.ExtType(2, b"\x92\x0c\xdd\xff\xff\xff\xff"))),
    "header-length-4GB": b"\xff\xff\xff\xff" + b"\0" * 60,
    "msgpack-nested-100000": frame_of(b"\x91" * 100_000 + b"\xc0"),
    "array-shape-2**40": _array_frame("int32", [2**40], 0, 4 * 2**40),
    "array-shape-product-wraps-int64": _array_frame("int8", [2**32, 2**32, 3], 0, 0),
    "array-shape-1000-dims": _array_frame("int8", [2**64 - 1] * 1000, 0, 1),
    "array-offset-2**64": _array_frame("int8", [1], 2**64 - 1, 1),
    "array-negative-offset": _array_frame("int8", [8], -8, 8),
    "array-object-dtype": _array_frame("object", [1], 0, 8),
    "array-dtype-not-a-string": _array_frame(["int8", "int8"], [1], 0, 1),
}


@pytest.mark.parametrize("frame", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_headers_are_refused_without_allocating(frame: bytes) -> None:
    tracemalloc.start()
    try:
        start = time.monotonic()
        with pytest.raises(codec.MalformedMessage):
            codec.decode(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert time.monotonic() - start < 1.0


def test_deeply_nested_messages_are_refused_not_a_crash() -> None:
    """Each nested message is a recursive ``msgpack.unpackb``; ~200 levels overflowed the C stack."""
    program = """if True:
        import msgpack
        from guidespec.ipc import codec
        inner = msgpack.packb(None)
        for _ in range(10_000):
            inner = msgpack.packb(msgpack.ExtType(2, b"\\x92\\x0c\\x91" + inner))
        try:
            codec.decode(codec._HEADER_LEN.pack(len(inner)) + inner)
        except codec.MalformedMessage as e:
            print(e)
    """
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "nested deeper than" in done.stdout


WRONG_TYPES = [  # dataclasses do not check types, so these encode; the receiver must not get them
    protocol.Shutdown(5),  # type: ignore[arg-type]
    protocol.AbortRequest(["not", "a", "str"]),  # type: ignore[arg-type]
    protocol.GenerateRequest("r", "abc", protocol.SamplingParams(), 0.0),  # type: ignore[arg-type]
    protocol.GenerateRequest("r", np.zeros(1, np.int32), 7, 0.0),  # type: ignore[arg-type]
    protocol.GenerateRequest("r", np.zeros(1, np.int32), protocol.SamplingParams(temperature="hot"), 0.0),  # type: ignore[arg-type]
    protocol.RequestOutput("r", ["x"]),  # type: ignore[list-item]
    protocol.StepOutputs(1, np.zeros(1, np.int32), None, 0.0),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("message", WRONG_TYPES, ids=lambda m: type(m).__name__)
def test_fields_of_the_wrong_type_are_refused(message: Any) -> None:
    with pytest.raises(codec.MalformedMessage, match="must be"):
        codec.decode(codec.encode(message))


# ---------------------------------------------------------------- over ZeroMQ


@pytest.fixture(scope="module")
def push_pull() -> Iterator[tuple[zmq.Socket, Channel]]:
    ctx = zmq.Context()
    endpoint = new_ipc_endpoint("fuzz")
    channel = Channel(ctx, zmq.PULL, endpoint, bind=True)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(endpoint)
    yield push, channel
    push.close()
    channel.close()
    ctx.term()


@seed(SEED)
@fuzz(40)
@given(st.lists(st.binary(max_size=64) | FRAMES.map(lambda f: f[: len(f) // 2]), min_size=1, max_size=4))
def test_channel_drops_fuzzed_frames_and_goes_on(push_pull: tuple[zmq.Socket, Channel], frames: list[bytes]) -> None:
    push, channel = push_pull
    before, malformed = channel.malformed_count, 0
    for frame in frames:
        push.send(frame)
        try:
            codec.decode(frame)
        except codec.MalformedMessage:
            malformed += 1
        else:
            assert channel.recv(timeout_s=5) is not None  # a fragment that still decodes: take it
    push.send(codec.encode(protocol.Shutdown("after the garbage")))
    assert channel.recv(timeout_s=5) == protocol.Shutdown("after the garbage")
    assert channel.malformed_count - before == malformed


def test_a_trickle_of_garbage_does_not_restart_the_timeout(push_pull: tuple[zmq.Socket, Channel]) -> None:
    push, channel = push_pull
    stop = threading.Event()

    def trickle() -> None:  # for 2 s at most: a recv that restarts its timeout fails, not hangs
        deadline = time.monotonic() + 2.0
        while not stop.wait(0.02) and time.monotonic() < deadline:
            push.send(b"garbage")

    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        start = time.monotonic()
        assert channel.recv(timeout_s=0.2) is None
        assert time.monotonic() - start < 1.0
    finally:
        stop.set()
        sender.join()
    while channel.recv(timeout_s=0.05) is not None:
        pass
