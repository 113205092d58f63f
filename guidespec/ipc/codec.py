"""msgpack framing of typed messages. Never pickle.

A frame is ``[u32 header length][msgpack header][8-byte aligned array payloads]``. Messages
are dataclasses registered with a fixed tag; numpy arrays inside them are written as raw
bytes after the header and decoded with ``np.frombuffer`` over the frame (no copy). Anything
that is not a registered message, a msgpack primitive, or a numeric numpy array is refused at
encode time; any frame that does not decode to a registered message raises
``MalformedMessage`` at decode time, and the receiver carries on.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, Callable, TypeVar

import msgpack
import numpy as np

_EXT_ARRAY = 1
_EXT_MESSAGE = 2
_ALLOWED_DTYPES = {"bool", "int8", "uint8", "int16", "int32", "int64", "uint32", "float16", "float32", "float64"}
_HEADER_LEN = struct.Struct("<I")

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
    arrays: list[np.ndarray] = []
    offset = [0]

    def default(obj: Any) -> msgpack.ExtType:
        if isinstance(obj, np.ndarray):
            return _encode_array(obj, arrays, offset)
        if isinstance(obj, np.generic):
            return obj.item()
        tag = _CLASS_TO_TAG.get(type(obj))
        if tag is None:
            raise TypeError(f"cannot encode {type(obj).__name__}")
        fields = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
        return msgpack.ExtType(_EXT_MESSAGE, msgpack.packb([tag, fields], default=default, use_bin_type=True))

    header = msgpack.packb(message, default=default, use_bin_type=True)
    parts = [_HEADER_LEN.pack(len(header)), header]
    pad = -(_HEADER_LEN.size + len(header)) % 8
    parts.append(b"\0" * pad)
    for array in arrays:
        raw = array.tobytes()
        parts.append(raw)
        parts.append(b"\0" * (-len(raw) % 8))
    return b"".join(parts)


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

    def ext_hook(code: int, data: bytes) -> Any:
        if code == _EXT_ARRAY:
            return _decode_array(data, view, payload_base)
        if code == _EXT_MESSAGE:
            return _decode_message(msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=True))
        raise MalformedMessage(f"unknown extension type {code}")

    try:
        message = msgpack.unpackb(view[start : start + header_len], ext_hook=ext_hook, raw=False)
    except MalformedMessage:
        raise
    except Exception as e:  # msgpack raises many types on garbage; all mean the same here
        raise MalformedMessage(f"undecodable frame: {type(e).__name__}: {e}") from None
    if type(message) not in _CLASS_TO_TAG:
        raise MalformedMessage(f"frame holds a {type(message).__name__}, not a registered message")
    return message


def _encode_array(array: np.ndarray, arrays: list[np.ndarray], offset: list[int]) -> msgpack.ExtType:
    if array.dtype.name not in _ALLOWED_DTYPES:
        raise TypeError(f"arrays of dtype {array.dtype} cannot be sent")
    array = np.ascontiguousarray(array)
    meta = [array.dtype.name, list(array.shape), offset[0], array.nbytes]
    arrays.append(array)
    offset[0] += array.nbytes + (-array.nbytes % 8)
    return msgpack.ExtType(_EXT_ARRAY, msgpack.packb(meta))


def _decode_array(data: bytes, view: memoryview, payload_base: int) -> np.ndarray:
    try:
        dtype_name, shape, offset, nbytes = msgpack.unpackb(data)
        dtype = np.dtype(dtype_name)
    except Exception as e:
        raise MalformedMessage(f"bad array header: {e}") from None
    if dtype_name not in _ALLOWED_DTYPES:
        raise MalformedMessage(f"array dtype {dtype_name!r} is not allowed")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise MalformedMessage(f"bad array shape {shape!r}")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count * dtype.itemsize != nbytes or offset < 0 or payload_base + offset + nbytes > view.nbytes:
        raise MalformedMessage(f"array of shape {shape} ({nbytes} bytes at {offset}) does not fit the frame")
    return np.frombuffer(view, dtype=dtype, count=count, offset=payload_base + offset).reshape(shape)


def _decode_message(item: Any) -> Any:
    if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int) and isinstance(item[1], list)):
        raise MalformedMessage("message must be [tag, fields]")
    tag, fields = item
    cls = _TAG_TO_CLASS.get(tag)
    if cls is None:
        raise MalformedMessage(f"unknown message tag {tag}")
    expected = dataclasses.fields(cls)
    if len(fields) != len(expected):
        raise MalformedMessage(f"{cls.__name__} has {len(expected)} fields, frame has {len(fields)}")
    try:
        return cls(*fields)
    except Exception as e:
        raise MalformedMessage(f"cannot build {cls.__name__}: {e}") from None
