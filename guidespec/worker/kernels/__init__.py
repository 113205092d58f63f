"""CPU kernels built at first use: the C source is compiled with the system's C compiler into
the cache directory and called through ctypes (no torch headers, so it builds in a second).

The kernels, fp32 activations:

- ``packed_linear.c``: linear layers over weights packed at load time (:class:`PackedWeight`;
  the file says why). The model packs its linear weights with :func:`pack` and multiplies with
  :func:`linear`; a tied embedding is packed once and looked up with :func:`embedding`. The same
  tiles read int8 weights with a scale per output row (:class:`QuantizedWeight`, made by
  :func:`quantize`): a quarter of the bytes, for the target's int8 copy as a draft model.
- ``gguf_linear.c``: linear layers over a GGUF file's own quantized blocks
  (:class:`~guidespec.worker.kernels.gguf_weights.GGUFWeight`, that module says which formats),
  activations rounded to int8 per block of 32 as llama.cpp does: :func:`linear` takes them too.
- ``attention.c``: :func:`cache_attention`, new tokens (any number per row) attending the KV cache in
  place (decode and draft verification).
- ``layer_ops.c``: a layer's small operations in one call each (:func:`add_rms_norm`,
  :func:`rope_into_cache`, :func:`silu_mul`), where torch's dispatch costs more than the work.
- ``logits_ops.c``: a bitmask applied to logits rows (:func:`apply_bitmask`) and the greedy pick
  of every row (:func:`argmax_rows`), one pass each.
- ``decoder.c``: every layer of a forward in one call (:class:`DecoderStack`), the same kernels
  in the same order as the model's Python loop, without the Python between them.

Without a compiler, or with ``GUIDESPEC_CPU_KERNELS=0``, :func:`pack` leaves weights as they
are, :func:`cache_attention` is unavailable, and everything runs on ``torch.nn.functional``.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from guidespec import envs, native
from guidespec.worker.kernels.gguf_weights import GGUFWeight

logger = logging.getLogger(__name__)
BLOCK = 16  # output rows per packed block (one AVX-512 vector, two AVX2 vectors: vec.h)
_SOURCES = [
    Path(__file__).with_name(name)
    for name in ("packed_linear.c", "gguf_linear.c", "attention.c", "layer_ops.c", "logits_ops.c", "decoder.c")
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
    lib.cache_attention_f32.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    lib.cache_attention_f32.restype = None
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.add_rms_norm_f32.argtypes = _signature(p, p, p, f, p, p, i, i, i)
    lib.add_rms_norm_f32.restype = None
    lib.rope_cache_f32.argtypes = _signature(p, i, i, i, i, p, p, p, p, p, p, i, p, i)
    lib.rope_cache_f32.restype = None
    lib.silu_mul_f32.argtypes = _signature(p, i, i, p, i)
    lib.silu_mul_f32.restype = None
    lib.apply_bitmask_f32.argtypes = _signature(p, i, p, p, i, i, i)
    lib.apply_bitmask_f32.restype = None
    lib.argmax_rows_f32.argtypes = _signature(p, i, i, p, p, i)
    lib.argmax_rows_f32.restype = None
    lib.decoder_forward_f32.argtypes = _signature(p, i, i, p, i, p, f, i, i, i, i, p, p, p, p, p, p, i, i, i, f, p, i)
    lib.decoder_forward_f32.restype = None
    return lib


def _signature(*types: Any) -> list[Any]:
    return list(types)


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
    if isinstance(weight, torch.Tensor) and weight.device.type != "cpu":  # no int8 kernel there: the values
        w = weight.float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        return (torch.round(w / scale).clamp(-127, 127) * scale).to(weight.dtype)
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


def linear_rows(x: torch.Tensor, weight: Weight, ids: np.ndarray) -> torch.Tensor | None:
    """``F.linear(x, weight)[:, ids]`` computing only those outputs (a GGUF weight, the kernel
    built), each equal to :func:`linear`'s; None where the kernel does not apply."""
    lib = _library()
    x = x.contiguous()
    if lib is None or not isinstance(weight, GGUFWeight) or x.dim() != 2 or not _fp32_cpu(x):
        return None
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    n, k = weight.shape
    if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < n:
        raise IndexError(f"rows {ids.min()}..{ids.max()} outside a weight of {n} rows")
    out = torch.empty(x.shape[0], len(ids), dtype=torch.float32)
    if x.shape[0] and len(ids):
        lib.gguf_linear_rows(
            x.data_ptr(),
            *weight.kernel_layout().pointers(),
            weight.fmt,
            ids.ctypes.data,
            len(ids),
            out.data_ptr(),
            x.shape[0],
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


def apply_bitmask(logits: torch.Tensor, rows: np.ndarray, bitmask: np.ndarray) -> bool:
    """Forbid (-inf) the tokens ``bitmask`` row i does not allow in ``logits[rows[i]]``, in place;
    False (nothing done) where the kernel does not apply."""
    lib = _library()
    if lib is None or logits.dim() != 2 or not _fp32_cpu(logits):
        return False
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    bitmask = np.ascontiguousarray(bitmask, dtype=np.int32)
    vocab = logits.shape[1]
    if bitmask.ndim != 2 or bitmask.shape[0] != len(rows) or bitmask.shape[1] * 32 < vocab:
        return False
    if len(rows) and not 0 <= int(rows.min()) <= int(rows.max()) < logits.shape[0]:
        raise IndexError(f"bitmask rows {rows.min()}..{rows.max()} outside {logits.shape[0]} logits rows")
    lib.apply_bitmask_f32(
        logits.data_ptr(),
        vocab,
        rows.ctypes.data,
        bitmask.ctypes.data,
        bitmask.shape[1],
        len(rows),
        torch.get_num_threads(),
    )
    return True


def argmax_rows(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """(each row's argmax as torch.argmax gives it, whether each row is all -inf) for logits
    [R, V], or None where the kernel does not apply."""
    lib = _library()
    if lib is None or logits.dim() != 2 or not _fp32_cpu(logits) or logits.shape[1] == 0:
        return None
    best = np.empty(logits.shape[0], dtype=np.int64)
    dead = np.empty(logits.shape[0], dtype=np.bool_)
    lib.argmax_rows_f32(
        logits.data_ptr(), logits.shape[0], logits.shape[1], best.ctypes.data, dead.ctypes.data, torch.get_num_threads()
    )
    return best, dead


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("format", ctypes.c_int),
        ("n", ctypes.c_int),
        ("k", ctypes.c_int),
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("c", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
    ]


def _linear_struct(weight: Weight, bias: torch.Tensor | None) -> _Linear | None:
    if bias is not None and not _fp32_cpu(bias):
        return None
    n, k = weight.shape
    bias_ptr = None if bias is None else bias.data_ptr()
    if isinstance(weight, GGUFWeight):
        qs, s0, s1 = weight.kernel_layout().pointers()
        return _Linear(2, weight.fmt, n, k, qs, s0, s1, bias_ptr)
    if isinstance(weight, QuantizedWeight):
        return _Linear(1, 0, n, k, weight.blocks.data_ptr(), weight.scale.data_ptr(), None, bias_ptr)
    if isinstance(weight, PackedWeight):
        return _Linear(0, 0, n, k, weight.blocks.data_ptr(), None, None, bias_ptr)
    return None


class DecoderStack:
    """A model's layers as ``decoder.c`` reads them: built once from the layers' weights (the
    model keeps them alive), the KV cache's pointers set per cache. :meth:`of` is None where a
    weight is of a kind the C stack does not take (the model's Python loop runs then)."""

    def __init__(self, layers: ctypes.Array, keep: list[torch.Tensor]) -> None:
        self.layers, self._keep = layers, keep
        self._kv: object = None

    @classmethod
    def of(cls, layers: list[dict[str, Any]]) -> DecoderStack | None:
        if _library() is None:
            return None
        structs = (_Layer * len(layers))()
        keep = []
        for struct, layer in zip(structs, layers):
            norms = [layer["input_norm"].float().contiguous(), layer["post_norm"].float().contiguous()]
            keep += norms
            struct.input_norm, struct.post_norm = norms[0].data_ptr(), norms[1].data_ptr()
            for name, bias in (("qkv", "qkv_bias"), ("o", "o_bias"), ("gate_up", None), ("down", None)):
                linear_struct = _linear_struct(layer[name], layer.get(bias) if bias else None)
                if linear_struct is None:
                    return None
                setattr(struct, name, linear_struct)
        return cls(structs, keep)

    def run(
        self,
        x: torch.Tensor,
        kv: Any,
        final_norm: torch.Tensor,
        eps: float,
        dims: tuple[int, int, int, int],
        rotary: tuple[torch.Tensor, torch.Tensor],
        rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        n: int,
    ) -> torch.Tensor | None:
        """The layers and the final norm over embeddings x [T, H] (B rows of ``n`` tokens), keys
        and values written into ``kv`` (a KVCache): the normalized hidden states [T, H], or None
        where the kernels do not apply. dims: heads, key/value heads, head dim, intermediate
        size; rotary: the [max_len, D] cos and sin tables; rows: positions and cache slots per
        token (int64), cache slots and first positions per row (int32)."""
        lib = _library()
        positions, token_slots, row_slots, row_starts = (t.contiguous() for t in rows)
        if lib is None or not _fp32_cpu(final_norm, *rotary) or dims[2] % 16:
            return None
        if self._kv is not kv:  # point the layers at this cache's keys and values
            if not _fp32_cpu(*kv.k, *kv.v):
                return None
            for struct, k, v in zip(self.layers, kv.k, kv.v):
                struct.k_cache, struct.v_cache = k.data_ptr(), v.data_ptr()
            self._kv = kv
        x = x.float().contiguous().clone()  # written in place: the residual stream
        hidden = torch.empty_like(x)
        hq, hkv, d, inter = dims
        lib.decoder_forward_f32(
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            ctypes.addressof(self.layers),
            len(self.layers),
            final_norm.data_ptr(),
            eps,
            hq,
            hkv,
            d,
            inter,
            rotary[0].data_ptr(),
            rotary[1].data_ptr(),
            positions.data_ptr(),
            token_slots.data_ptr(),
            row_slots.data_ptr(),
            row_starts.data_ptr(),
            len(row_slots),
            n,
            kv.max_len,
            d**-0.5,
            hidden.data_ptr(),
            torch.get_num_threads(),
        )
        return hidden
