"""CPU kernels built at first use: the C source is compiled with the system's C compiler into
the cache directory and called through ctypes (no torch headers, so it builds in a second).

Two kernels, fp32 activations:

- ``packed_linear.c``: linear layers over weights packed at load time (:class:`PackedWeight`;
  the file says why). The model packs its linear weights with :func:`pack` and multiplies with
  :func:`linear`; a tied embedding is packed once and looked up with :func:`embedding`. The same
  tiles read int8 weights with a scale per output row (:class:`QuantizedWeight`, made by
  :func:`quantize`): a quarter of the bytes, for the target's int8 copy as a draft model.
- ``gguf_linear.c``: linear layers over a GGUF file's own quantized blocks
  (:class:`~guidespec.worker.kernels.gguf_weights.GGUFWeight`, that module says which formats),
  activations rounded to int8 per block of 32 as llama.cpp does: :func:`linear` takes them too.
- ``attention.c``: :func:`cache_attention`, a few new tokens per row attending the KV cache in
  place (decode and draft verification).
- ``layer_ops.c``: a layer's small operations in one call each (:func:`add_rms_norm`,
  :func:`rope_into_cache`, :func:`silu_mul`), where torch's dispatch costs more than the work.

Without a compiler, or with ``GUIDESPEC_CPU_KERNELS=0``, :func:`pack` leaves weights as they
are, :func:`cache_attention` is unavailable, and everything runs on ``torch.nn.functional``.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from guidespec import envs, native
from guidespec.worker.kernels.gguf_weights import GGUFWeight

logger = logging.getLogger(__name__)
BLOCK = 16  # output rows per packed block (one AVX-512 vector, two AVX2 vectors: vec.h)
_SOURCES = [
    Path(__file__).with_name(name) for name in ("packed_linear.c", "gguf_linear.c", "attention.c", "layer_ops.c")
]
_HEADERS = [Path(__file__).with_name(name) for name in ("vec.h", "vmath.h")]


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if not envs.cpu_kernels_enabled():
        return None
    path = build(["-march=native"])
    return None if path is None else load(path)


def build(arch_flags: list[str]) -> Path | None:
    """The kernels compiled for ``arch_flags`` (the engine's: ``-march=native``), cached by source,
    compiler, flags and CPU; None (with a warning) where there is no compiler or it fails."""
    return native.build_shared("guidespec-cpu", _SOURCES, _HEADERS, ["-O3", *arch_flags, "-fopenmp"], ["-lm"])


def load(path: Path) -> ctypes.CDLL:
    """A built kernel library, its functions typed."""
    lib = ctypes.CDLL(str(path))
    lib.packed_linear_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    lib.packed_linear_f32.restype = None
    lib.packed_linear_i8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
    lib.packed_linear_i8.restype = None
    lib.gguf_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4
    lib.gguf_linear.restype = None
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
    lib.cache_attention_f32.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    lib.cache_attention_f32.restype = None
    pointers: list[type] = [ctypes.c_void_p]
    lib.add_rms_norm_f32.argtypes = pointers * 3 + [ctypes.c_float] + pointers * 2 + [ctypes.c_int] * 3
    lib.add_rms_norm_f32.restype = None
    lib.rope_cache_f32.argtypes = (
        [ctypes.c_void_p] + [ctypes.c_int] * 4 + [ctypes.c_void_p] * 6 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    )
    lib.rope_cache_f32.restype = None
    lib.silu_mul_f32.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.silu_mul_f32.restype = None
    return lib


def available() -> bool:
    return _library() is not None


class PackedWeight:
    """An fp32 [N, K] weight stored as ``blocks`` [ceil(N/16), K, 16]: 16 output rows side by
    side for each k (the last block zero-padded). Same ``shape`` as the weight it packs."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        padded = torch.zeros(-(-n // BLOCK) * BLOCK, k, dtype=torch.float32)
        padded[:n] = weight
        self.blocks = padded.view(-1, BLOCK, k).transpose(1, 2).contiguous()
        self.shape = torch.Size((n, k))
        self.dtype = torch.float32
        self.device = torch.device("cpu")

    def unpack(self) -> torch.Tensor:
        return self.blocks.transpose(1, 2).reshape(-1, self.shape[1])[: self.shape[0]]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``weight[ids]`` (an embedding lookup): [*ids.shape, K]."""
        return self.blocks[ids // BLOCK, :, ids % BLOCK]


class QuantizedWeight:
    """An [N, K] weight as int8 with one fp32 scale per output row (symmetric: the row's largest
    magnitude maps to 127), packed like :class:`PackedWeight`: ``blocks`` int8 [ceil(N/16), K, 16],
    ``scale`` [ceil(N/16) * 16] (zero past N)."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        padded = torch.zeros(-(-n // BLOCK) * BLOCK, k, dtype=torch.int8)
        padded[:n] = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.blocks = padded.view(-1, BLOCK, k).transpose(1, 2).contiguous()
        self.scale = torch.zeros(padded.shape[0], dtype=torch.float32)
        self.scale[:n] = scale
        self.shape = torch.Size((n, k))
        self.dtype = torch.float32
        self.device = torch.device("cpu")

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        return self.blocks.transpose(1, 2).reshape(-1, k)[:n].float() * self.scale[:n, None]


Weight = torch.Tensor | PackedWeight | QuantizedWeight | GGUFWeight


def pack(weight: torch.Tensor) -> Weight:
    """The weight packed for :func:`linear` when the kernel applies (fp32, 2-D, on the CPU, a
    compiled kernel), else the weight itself."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu" or _library() is None:
        return weight
    return PackedWeight(weight)


def quantize(weight: Weight) -> Weight:
    """The weight rounded to int8 with a scale per output row: a :class:`QuantizedWeight` for
    :func:`linear` where the kernel is built, else the rounded values as fp32 (the same numbers,
    without the saving). A GGUF weight is already smaller: it stays as it is."""
    if isinstance(weight, GGUFWeight):
        return weight
    quantized = QuantizedWeight(dense(weight))
    return quantized if _library() is not None else quantized.dequantize()


def dense(weight: Weight) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize()
    if isinstance(weight, GGUFWeight):
        return weight.dequantize(lib=_library())
    return weight.unpack() if isinstance(weight, PackedWeight) else weight


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for 2-D x; packed, int8 and GGUF weights go to the kernels."""
    if not isinstance(weight, PackedWeight | QuantizedWeight | GGUFWeight):
        return F.linear(x, weight, bias)
    lib = _library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, dense(weight).to(x.dtype), bias)
    n, k = weight.shape
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    if x.shape[0]:
        bias = None if bias is None else bias.float().contiguous()
        bias_ptr = None if bias is None else bias.data_ptr()
        if isinstance(weight, GGUFWeight):
            lib.gguf_linear(
                x.data_ptr(),
                *weight.kernel_layout().pointers(),
                weight.fmt,
                bias_ptr,
                out.data_ptr(),
                x.shape[0],
                n,
                k,
                torch.get_num_threads(),
            )
        elif isinstance(weight, QuantizedWeight):
            lib.packed_linear_i8(
                x.data_ptr(),
                weight.blocks.data_ptr(),
                weight.scale.data_ptr(),
                bias_ptr,
                out.data_ptr(),
                x.shape[0],
                n,
                k,
                torch.get_num_threads(),
            )
        else:
            lib.packed_linear_f32(
                x.data_ptr(),
                weight.blocks.data_ptr(),
                bias_ptr,
                out.data_ptr(),
                x.shape[0],
                n,
                k,
                torch.get_num_threads(),
            )
    return out


def embedding(token_ids: torch.Tensor, weight: Weight) -> torch.Tensor:
    """``F.embedding`` that also reads a packed (tied) or int8 embedding."""
    if isinstance(weight, PackedWeight):
        return weight.rows(token_ids)
    if isinstance(weight, GGUFWeight):
        return weight.dequantize(token_ids, _library())
    if isinstance(weight, QuantizedWeight):
        return weight.blocks[token_ids // BLOCK, :, token_ids % BLOCK].float() * weight.scale[token_ids, None]
    return F.embedding(token_ids, weight)


MAX_CACHE_ATTENTION_TOKENS = 64  # new tokens per row up to which cache_attention applies


def cache_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    num_new_tokens: int,
    num_query_groups: int,
) -> torch.Tensor | None:
    """Attention of ``num_new_tokens`` new tokens per row over one layer's cache, or None where
    the kernel does not apply (torch does it then).

    q [B * n, hkv * g, D] (row after row); k_cache, v_cache [num_slots, hkv, max_len, D] with the
    new tokens' keys already written; slots, starts [B] int32: each row's cache slot and the
    position of its first new token. Returns [B * n, hkv * g, D].
    """
    lib = _library()
    if (
        lib is None
        or num_new_tokens > MAX_CACHE_ATTENTION_TOKENS
        or q.shape[-1] % 16
        or q.dtype != torch.float32
        or k_cache.dtype != torch.float32
        or q.device.type != "cpu"
        or not k_cache.is_contiguous()
        or not v_cache.is_contiguous()
    ):
        return None
    _, hkv, max_len, d = k_cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    lib.cache_attention_f32(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        slots.data_ptr(),
        starts.data_ptr(),
        len(slots),
        num_new_tokens,
        hkv,
        num_query_groups,
        d,
        max_len,
        d**-0.5,
        torch.get_num_threads(),
    )
    return out


def _fp32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + delta, RMS norm of it times ``weight``) for x [T, H] (delta None: x and its norm), or
    None where the kernel does not apply."""
    lib = _library()
    if lib is None or x.dim() != 2 or not _fp32_cpu(x, weight, *(() if delta is None else (delta,))):
        return None
    t, h = x.shape
    out = x if delta is None else torch.empty_like(x)
    norm = torch.empty_like(x)
    lib.add_rms_norm_f32(
        x.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        norm.data_ptr(),
        t,
        h,
        torch.get_num_threads(),
    )
    return out, norm


def rope_into_cache(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor | None:
    """Rotary embedding of qkv [T, (hq + 2 hkv) * D]'s q and k heads at ``positions`` (cos, sin:
    the model's [max_len, D] tables), k and v written into one layer's cache [slots, hkv, max_len,
    D] at (``slots``, ``positions``) (int64 [T]); returns q [T, hq, D], or None where the kernel
    does not apply (nothing is written then)."""
    lib = _library()
    if (
        lib is None
        or qkv.dim() != 2
        or not _fp32_cpu(qkv, cos, sin, k_cache, v_cache)
        or positions.dtype != torch.int64
        or slots.dtype != torch.int64
        or not positions.is_contiguous()
        or not slots.is_contiguous()
    ):
        return None
    d = k_cache.shape[-1]
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, d, dtype=torch.float32)
    lib.rope_cache_f32(
        qkv.data_ptr(),
        t,
        num_heads,
        num_kv_heads,
        d,
        cos.data_ptr(),
        sin.data_ptr(),
        positions.data_ptr(),
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[2],
        q.data_ptr(),
        torch.get_num_threads(),
    )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [T, 2 I] (gate | up): [T, I]; None where the kernel does not apply."""
    lib = _library()
    if lib is None or gate_up.dim() != 2 or not _fp32_cpu(gate_up):
        return None
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, i, dtype=torch.float32)
    lib.silu_mul_f32(gate_up.data_ptr(), t, i, out.data_ptr(), torch.get_num_threads())
    return out
