"""Building and loading the CPU kernels' C library: compiled at first use with the system's C
compiler into the cache directory (:func:`build`), its functions typed for ctypes (:func:`load`),
and the engine's one copy (:func:`library`)."""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from guidespec import envs, native

_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "pool.c",
        "packed_linear.c",
        "gguf_linear.c",
        "attention.c",
        "layer_ops.c",
        "logits_ops.c",
        "decoder.c",
    )
]
_HEADERS = [Path(__file__).with_name(name) for name in ("vec.h", "vmath.h", "parallel.h", "pool.h")]
# every kernel library this process has loaded (``load``), each with its thread pool
LOADED: list[ctypes.CDLL] = []


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    if not envs.cpu_kernels_enabled():
        return None
    path = build(["-march=native"])
    if path is None:
        return None
    lib = load(path)
    lib.pool_set_spin_us(envs.kernel_spin_us())
    if not envs.amx():
        lib.packed_checked_amx(0)
    return lib


def build(arch_flags: list[str]) -> Path | None:
    """The kernels compiled for ``arch_flags`` (the engine's: ``-march=native``), cached by source,
    compiler, flags and CPU; None (with a warning) where there is no compiler or it fails."""
    return native.build_shared("guidespec-cpu", _SOURCES, _HEADERS, ["-O3", *arch_flags, "-pthread"], ["-lm"])


def load(path: Path) -> ctypes.CDLL:
    """A built kernel library, its functions typed."""
    lib = ctypes.CDLL(str(path))
    lib.pool_park.argtypes = []
    lib.pool_park.restype = None
    lib.pool_set_spin_us.argtypes = [ctypes.c_long]
    lib.pool_set_spin_us.restype = None
    if all(other._handle != lib._handle for other in LOADED):  # (a build loaded again: the same pool)
        LOADED.append(lib)
    lib.packed_linear_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    lib.packed_linear_f32.restype = None
    lib.packed_rows_f32.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.packed_rows_f32.argtypes += [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.packed_rows_f32.restype = ctypes.c_int
    lib.packed_linear_i8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
    lib.packed_linear_i8.restype = None
    picks = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2
    lib.packed_linear_argmax_f32.argtypes = picks + [ctypes.c_int]
    lib.packed_linear_argmax_f32.restype = ctypes.c_int
    lib.packed_linear_argmax_i8.argtypes = [ctypes.c_void_p] + picks + [ctypes.c_int]
    lib.packed_linear_argmax_i8.restype = ctypes.c_int
    checked: list[Any] = [ctypes.c_void_p] * 8 + [ctypes.c_float]  # x, wp, qp, scale, sums, err, err2, block_err, reach
    lib.packed_checked_offset.argtypes = []
    lib.packed_checked_offset.restype = ctypes.c_int
    lib.packed_checked_weight_levels.argtypes = []
    lib.packed_checked_weight_levels.restype = ctypes.c_int
    lib.packed_checked_amx.argtypes = [ctypes.c_int]
    lib.packed_checked_amx.restype = ctypes.c_int
    lib.packed_linear_argmax_checked.argtypes = checked + picks[3:] + [ctypes.c_int]  # (no bias)
    lib.packed_linear_argmax_checked.restype = ctypes.c_int
    lib.gguf_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4
    lib.gguf_linear.restype = None
    lib.gguf_linear_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.gguf_linear_rows.argtypes += [ctypes.c_void_p] + [ctypes.c_int] * 3
    lib.gguf_linear_rows.restype = None
    lib.gguf_dequantize_rows.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.gguf_dequantize_rows.restype = None
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.cache_attention_f32.argtypes = _signature(p, p, p, p, p, i, p, i, i, i, i, i, i, i, f, i, i)
    lib.cache_attention_f32.restype = None
    lib.add_rms_norm_f32.argtypes = _signature(p, p, p, f, p, p, i, i, i)
    lib.add_rms_norm_f32.restype = None
    lib.rope_cache_f32.argtypes = _signature(p, i, i, i, i, p, p, p, p, p, p, i, i, p, i)
    lib.rope_cache_f32.restype = None
    lib.silu_mul_f32.argtypes = _signature(p, i, i, p, i)
    lib.silu_mul_f32.restype = None
    lib.apply_bitmask_f32.argtypes = _signature(p, i, p, p, i, i, i)
    lib.apply_bitmask_f32.restype = None
    lib.argmax_rows_f32.argtypes = _signature(p, i, i, p, p, i, p, p, i)
    lib.argmax_rows_f32.restype = None
    lib.single_token_rows.argtypes = _signature(p, i, i, i, p)
    lib.single_token_rows.restype = None
    lib.decoder_forward_f32.argtypes = _signature(
        p, i, i, p, i, p, f, i, i, i, i, p, p, p, p, p, i, p, i, i, i, i, f, p, i
    )
    lib.decoder_forward_f32.restype = None
    return lib


def _signature(*types: Any) -> list[Any]:
    return list(types)


def available() -> bool:
    return library() is not None


_threads: int | None = None  # set_threads'


def set_threads(count: int | None) -> None:
    """The kernels' thread count (their pool's team), apart from torch's own (None: torch's).

    A CPU worker gives the kernels its threads and torch one: torch's OpenMP team, spinning
    after its own parallel ops, and the kernels' pool otherwise ran three busy threads on two
    cores (the default model at 16 requests lost a quarter of its tokens a second)."""
    global _threads
    _threads = count


def threads() -> int:
    """The kernels' thread count: :func:`set_threads`', else torch's."""
    return _threads if _threads is not None else torch.get_num_threads()
