"""msgpack framing of typed messages. Never pickle.

A frame is ``[u32 header length][msgpack header][8-byte aligned array payloads]``. Messages
are dataclasses registered with a fixed tag; numpy arrays inside them are written as raw
bytes after the header and decoded with ``np.frombuffer`` over the frame (no copy). Anything
that is not a registered message, a msgpack primitive, or a numeric numpy array is refused at
encode time; any frame that does not decode to a registered message, each field of the type
its annotation names, raises ``MalformedMessage`` at decode time, and the receiver carries on.
Decoding allocates no more than the frame's size suggests: msgpack's own limits bound declared
lengths by the bytes present, arrays are views checked against the frame, and messages may nest
only ``_MAX_NESTED_MESSAGES`` deep (each level is a C-stack-hungry ``unpackb`` call: a few
hundred levels crash the process).

What a field's value means (a token id in range, a positive count) is the receiver's to check:
the codec checks only types, and not an array's dtype or shape.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import struct
import threading
import types
import typing
from typing import Any, Callable, TypeVar

import msgpack
import numpy as np

_EXT_ARRAY = 1
_EXT_MESSAGE = 2
_ALLOWED_DTYPES = {"bool", "int8", "uint8", "int16", "int32", "int64", "uint32", "float16", "float32", "float64"}
_DTYPE_NAMES = {np.dtype(name): name for name in _ALLOWED_DTYPES}  # dtype.name costs microseconds a call
_DTYPES = {name: np.dtype(name) for name in _ALLOWED_DTYPES}
_HEADER_LEN = struct.Struct("<I")
_MAX_NESTED_MESSAGES = 8  # the deepest in use: GenerateRequest > SamplingParams > GuidedDecoding
_MAX_NDIM = 32  # numpy's own limit before 2.0; also bounds the cost of a shape's product

_TAG_TO_CLASS: dict[int, type] = {}
_CLASS_TO_TAG: dict[type, int] = {}

T = TypeVar("T")


class MalformedMessage(ValueError):
    """A frame that is not a valid encoding of a registered message."""


def register_message(tag: int) -> Callable[[type[T]], type[T]]:
    """Class decorator: give a dataclass a fixed wire tag."""

    def wrap(cls: type[T]) -> type[T]:
        if tag in _TAG_TO_CLASS and _TAG_TO_CLASS[tag] is not cls:
            raise ValueError(f"message tag {tag} already used by {_TAG_TO_CLASS[tag].__name__}")
        _TAG_TO_CLASS[tag] = cls
        _CLASS_TO_TAG[cls] = tag
        return cls

    return wrap


def encode(message: Any) -> bytes:
    """Encode a registered message into one frame."""
    if type(message) not in _CLASS_TO_TAG:
        raise TypeError(f"{type(message).__name__} is not a registered message")
    encoder = getattr(_local, "encoder", None)
    if encoder is None:
        encoder = _local.encoder = _Encoder()
    header, arrays = encoder.encode(message)
    parts = [_HEADER_LEN.pack(len(header)), header]
    pad = -(_HEADER_LEN.size + len(header)) % 8
    parts.append(b"\0" * pad)
    for array in arrays:
        raw = array.tobytes()
        parts.append(raw)
        parts.append(b"\0" * (-len(raw) % 8))
    return b"".join(parts)


class _Encoder:
    """One thread's msgpack packers, one per nesting depth, kept between messages: a packer is
    costly to make (``msgpack.packb`` makes one per call, with a fresh buffer), and the
    ``default`` hook packs nested messages and array headers while its caller is mid-pack."""

    def __init__(self) -> None:
        self.packers: list[msgpack.Packer] = []
        self.meta_packer = msgpack.Packer(use_bin_type=True, autoreset=True)  # array headers: primitives only
        self.depth = 0
        self.arrays: list[np.ndarray] = []
        self.offset = [0]

    def encode(self, message: Any) -> tuple[bytes, list[np.ndarray]]:
        self.arrays, self.offset, self.depth = [], [0], 0
        try:
            return self.pack(message), self.arrays
        except BaseException:
            self.packers = []  # a packer stopped mid-message: start afresh
            raise

    def pack(self, obj: Any) -> bytes:
        if self.depth == len(self.packers):
            self.packers.append(msgpack.Packer(default=self.default, use_bin_type=True, autoreset=True))
        packer = self.packers[self.depth]
        self.depth += 1
        try:
            return packer.pack(obj)
        finally:
            self.depth -= 1

    def default(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return _encode_array(obj, self.arrays, self.offset, self.meta_packer.pack)
        if isinstance(obj, np.generic):
            return obj.item()
        tag = _CLASS_TO_TAG.get(type(obj))
        if tag is None:
            raise TypeError(f"cannot encode {type(obj).__name__}")
        return _ext(_EXT_MESSAGE, self.pack([tag, _fields_of(obj)]))


_local = threading.local()


def decode(frame: bytes | bytearray | memoryview) -> Any:
    """Decode one frame; arrays are read-only views into ``frame``."""
    view = memoryview(frame)
    if view.nbytes < _HEADER_LEN.size:
        raise MalformedMessage(f"frame of {view.nbytes} bytes is shorter than its header")
    (header_len,) = _HEADER_LEN.unpack_from(view, 0)
    start = _HEADER_LEN.size
    if start + header_len > view.nbytes:
        raise MalformedMessage(f"header length {header_len} exceeds the frame ({view.nbytes} bytes)")
    payload_base = start + header_len + (-(start + header_len) % 8)
    depth = [0]

    def ext_hook(code: int, data: bytes) -> Any:
        if code == _EXT_ARRAY:
            return _decode_array(data, view, payload_base)
        if code != _EXT_MESSAGE:
            raise MalformedMessage(f"unknown extension type {code}")
        if depth[0] >= _MAX_NESTED_MESSAGES:
            raise MalformedMessage(f"messages nested deeper than {_MAX_NESTED_MESSAGES}")
        depth[0] += 1
        try:
            return _decode_message(msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=True))
        finally:
            depth[0] -= 1

    try:
        message = msgpack.unpackb(view[start : start + header_len], ext_hook=ext_hook, raw=False)
    except MalformedMessage:
        raise
    except Exception as e:  # msgpack raises many types on garbage; all mean the same here
        raise MalformedMessage(f"undecodable frame: {type(e).__name__}: {e}") from None
    if type(message) not in _CLASS_TO_TAG:
        raise MalformedMessage(f"frame holds a {type(message).__name__}, not a registered message")
    return message


def _fields_of(message: Any) -> list[Any]:
    """A message's field values in order (an ``attrgetter`` per class: 0.5 µs for a 13-field
    message, against 1.3 for a ``getattr`` each; a step's 64 deltas are 64 messages)."""
    getter = _FIELD_GETTERS.get(type(message))
    if getter is None:
        names = [f.name for f in dataclasses.fields(message)]
        getter = _FIELD_GETTERS[type(message)] = operator.attrgetter(*names) if len(names) > 1 else _single(names)
    return list(getter(message))


def _single(names: list[str]) -> Callable[[Any], tuple[Any, ...]]:
    """The getter of a message with one field or none, as a tuple."""
    return lambda message: tuple(getattr(message, name) for name in names)


_FIELD_GETTERS: dict[type, Callable[[Any], Any]] = {}


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    """``msgpack.ExtType(code, data)`` without its argument checks (0.3 µs against 0.9): the
    codes are this module's and the data a packer's bytes."""
    return tuple.__new__(msgpack.ExtType, (code, data))  # type: ignore[type-var, no-any-return]


def _encode_array(
    array: np.ndarray, arrays: list[np.ndarray], offset: list[int], pack: Callable[[Any], bytes]
) -> msgpack.ExtType:
    dtype_name = _DTYPE_NAMES.get(array.dtype)
    if dtype_name is None:
        raise TypeError(f"arrays of dtype {array.dtype} cannot be sent")
    meta = [dtype_name, list(array.shape), offset[0], array.nbytes]  # tobytes() writes C order
    arrays.append(array)
    offset[0] += array.nbytes + (-array.nbytes % 8)
    return _ext(_EXT_ARRAY, pack(meta))


def _decode_array(data: bytes, view: memoryview, payload_base: int) -> np.ndarray:
    header = _ARRAY_HEADERS.get(data)
    if header is None:
        header = _array_header(data)
        if len(_ARRAY_HEADERS) >= _MAX_ARRAY_HEADERS:
            _ARRAY_HEADERS.clear()
        _ARRAY_HEADERS[data] = header
    dtype, shape, count, offset, nbytes = header
    if payload_base + offset + nbytes > view.nbytes:
        raise MalformedMessage(f"array of shape {list(shape)} ({nbytes} bytes at {offset}) does not fit the frame")
    array = np.frombuffer(view, dtype=dtype, count=count, offset=payload_base + offset)
    return array if len(shape) == 1 else array.reshape(shape)


def _array_header(data: bytes) -> tuple[np.dtype, tuple[int, ...], int, int, int]:
    """An array's header read and checked: (dtype, shape, element count, offset, bytes)."""
    try:
        dtype_name, shape, offset, nbytes = msgpack.unpackb(data)
    except Exception as e:
        raise MalformedMessage(f"bad array header: {e}") from None
    dtype = _DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        raise MalformedMessage(f"array dtype {dtype_name!r} is not allowed")
    if type(shape) is not list or len(shape) > _MAX_NDIM:
        raise MalformedMessage(f"bad array shape {shape!r}")
    count = 1  # exact (Python integers): a product that overflows int64 must not wrap to a small size
    for d in shape:
        if type(d) is not int or d < 0:
            raise MalformedMessage(f"bad array shape {shape!r}")
        count *= d
    if not (type(offset) is int and type(nbytes) is int and offset >= 0):
        raise MalformedMessage(f"bad array offset {offset!r} or size {nbytes!r}")
    if count * dtype.itemsize != nbytes:
        raise MalformedMessage(f"array of shape {shape} ({nbytes} bytes at {offset}) does not fit the frame")
    return dtype, tuple(shape), count, offset, nbytes


# array headers read before, by their bytes: a step's messages repeat theirs (the same arrays at the
# same offsets), and reading one costs ~2 µs, a dozen a step's inputs (the frame check stays per call)
_ARRAY_HEADERS: dict[bytes, tuple[np.dtype, tuple[int, ...], int, int, int]] = {}
_MAX_ARRAY_HEADERS = 4096


def _decode_message(item: Any) -> Any:
    if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int) and isinstance(item[1], list)):
        raise MalformedMessage("message must be [tag, fields]")
    tag, fields = item
    cls = _TAG_TO_CLASS.get(tag)
    if cls is None:
        raise MalformedMessage(f"unknown message tag {tag}")
    checks = _field_checks(cls)
    if len(fields) != len(checks):
        raise MalformedMessage(f"{cls.__name__} has {len(checks)} fields, frame has {len(fields)}")
    for (name, expected, check), value in zip(checks, fields):
        if not check(value):
            raise MalformedMessage(f"{cls.__name__}.{name} must be {expected}, frame has a {type(value).__name__}")
    try:
        return _builder(cls)(fields)
    except Exception as e:
        raise MalformedMessage(f"cannot build {cls.__name__}: {e}") from None


@functools.cache
def _builder(cls: type) -> Callable[[list[Any]], Any]:
    """How a decoded message of ``cls`` is made from its checked fields: ``cls(*fields)``, or,
    where that would only set each field (no ``__post_init__``, no slots), the fields set at
    once (1 µs for a 13-field frozen ``RequestOutput``, against 3 through its ``__init__``)."""
    declared = dataclasses.fields(cls)
    if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__") or not all(f.init for f in declared):
        return lambda fields: cls(*fields)
    names = [f.name for f in declared]

    def build(fields: list[Any]) -> Any:
        message: Any = object.__new__(cls)
        message.__dict__.update(zip(names, fields))
        return message

    return build


@functools.cache
def _field_checks(cls: type) -> list[tuple[str, str, Callable[[Any], bool]]]:
    """Each field's name, annotation and type check; built on first use (the classes are defined
    after the codec, some naming others defined later) and kept: decoding is on the hot path."""
    hints = typing.get_type_hints(cls)
    return [(f.name, _hint_name(hints[f.name]), _type_check(hints[f.name])) for f in dataclasses.fields(cls)]


def _type_check(hint: Any) -> Callable[[Any], bool]:
    """A predicate: does a decoded value fit the annotation? msgpack gives lists for tuples and
    may give an int for a float (a float field set to ``1``); other generics are checked as their
    container."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        if all(typing.get_origin(h) is None for h in args):
            simple = tuple(t for h in args for t in _simple_types(h))
            return lambda value: isinstance(value, simple)
        checks = [_type_check(h) for h in args]
        return lambda value: any(check(value) for check in checks)
    if origin is tuple and args and args[-1] is not Ellipsis:
        checks = [_type_check(h) for h in args]
        return lambda value: (
            isinstance(value, list) and len(value) == len(checks) and all(check(v) for check, v in zip(checks, value))
        )
    if origin is list or origin is tuple:
        item = _type_check(args[0]) if args else lambda value: True
        return lambda value: isinstance(value, list) and all(item(v) for v in value)
    if origin is not None:
        return lambda value: isinstance(value, origin)
    simple = _simple_types(hint)
    return lambda value: isinstance(value, simple)


def _simple_types(hint: Any) -> tuple[type, ...]:
    if hint is Any:
        return (object,)
    return (int, float) if hint is float else (hint,)


def _hint_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint)
