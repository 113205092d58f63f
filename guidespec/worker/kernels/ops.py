"""The kernels' operations, each falling back to torch (or answering None) where the kernel does
not apply: linear layers over any :data:`~guidespec.worker.kernels.weights.Weight`, embedding
lookups, attention over the KV cache, a layer's small operations, and the logits' bitmask and
greedy pick."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from guidespec.worker.kernels import loader
from guidespec.worker.kernels.gguf_weights import GGUFWeight
from guidespec.worker.kernels.weights import BLOCK, PackedWeight, QuantizedWeight, Weight, dense

# rows whose picks :func:`linear_argmax` makes from a packed LM head's int8 copy where it has one
# (``PicksCheck``), checked exactly, where the kernel's int8 copy is widened to fp32 (no AVX2): the
# head is read from memory for so few rows, a quarter of its bytes (with int8 sums, AVX-512 VNNI's
# or AVX2's, every row count: 64 rows of the tiny model's head 7.3 -> 2.2 ms on a Zen 3)
CHECKED_ROWS = 6


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for 2-D x; packed, int8 and GGUF weights go to the kernels."""
    if not isinstance(weight, PackedWeight | QuantizedWeight | GGUFWeight):
        return F.linear(x, weight, bias)
    lib = loader.library()
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
                loader.threads(),
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
                loader.threads(),
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
                loader.threads(),
            )
    return out


def linear_rows(x: torch.Tensor, weight: Weight, ids: np.ndarray) -> torch.Tensor | None:
    """``F.linear(x, weight)[:, ids]`` computing only those outputs (a GGUF weight, the kernel
    built), each equal to :func:`linear`'s; None where the kernel does not apply."""
    lib = loader.library()
    x = x.contiguous()
    if lib is None or not isinstance(weight, GGUFWeight) or x.dim() != 2 or not fp32_cpu(x):
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
            loader.threads(),
        )
    return out


def embedding(token_ids: torch.Tensor, weight: Weight) -> torch.Tensor:
    """``F.embedding`` that also reads a packed (tied) or int8 embedding."""
    if isinstance(weight, PackedWeight):
        lib = loader.library()
        if lib is None or token_ids.dtype != torch.int64 or token_ids.dim() != 1 or not token_ids.is_contiguous():
            return weight.rows(token_ids)
        n, k = weight.shape
        out = torch.empty(token_ids.shape[0], k)
        ids = token_ids.data_ptr()
        bad = lib.packed_rows_f32(weight.blocks.data_ptr(), n, k, ids, token_ids.shape[0], out.data_ptr())
        if bad >= 0:
            raise IndexError(f"token id {int(token_ids[bad])} is out of the embedding's range [0, {n})")
        return out
    if isinstance(weight, GGUFWeight):
        return weight.dequantize(token_ids, loader.library())
    if isinstance(weight, QuantizedWeight):
        return weight.blocks[token_ids // BLOCK, :, token_ids % BLOCK].float() * weight.scale[token_ids, None]
    return F.embedding(token_ids, weight)


def cache_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    starts: torch.Tensor,
    num_new_tokens: int,
    num_query_groups: int,
    window: int | None = None,
) -> torch.Tensor | None:
    """Attention of ``num_new_tokens`` new tokens per row over one layer's cache, or None where
    the kernel does not apply (torch does it then). With a sliding ``window`` a query at
    position p attends the keys at p - window + 1 .. p only.

    q [B * n, hkv * g, D] (row after row); k_cache, v_cache [hkv, num_blocks, block_size, D] with
    the new tokens' keys already written; tables [B, W] int32: each row's cache blocks in position
    order (position p in block ``tables[r, p // block_size]``; block_size a multiple of 8, or the
    whole length with one block a row: the cache by slot); starts [B] int32: the position of each
    row's first new token. Returns [B * n, hkv * g, D].
    """
    lib = loader.library()
    if (
        lib is None
        or q.shape[-1] % 16
        or q.dtype != torch.float32
        or k_cache.dtype != torch.float32
        or q.device.type != "cpu"
        or not k_cache.is_contiguous()
        or not v_cache.is_contiguous()
        or tables.dim() != 2
        or tables.dtype != torch.int32
        or not tables.is_contiguous()
    ):
        return None
    hkv, num_blocks, block_size, d = k_cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    lib.cache_attention_f32(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        starts.data_ptr(),
        len(tables),
        num_new_tokens,
        hkv,
        num_query_groups,
        d,
        block_size,
        num_blocks,
        d**-0.5,
        window or 0,
        loader.threads(),
    )
    return out


def fp32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + delta, RMS norm of it times ``weight``) for x [T, H] (delta None: x and its norm), or
    None where the kernel does not apply."""
    lib = loader.library()
    if lib is None or x.dim() != 2 or not fp32_cpu(x, weight, *(() if delta is None else (delta,))):
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
        loader.threads(),
    )
    return out, norm


def rope_into_cache(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor | None:
    """Rotary embedding of qkv [T, (hq + 2 hkv) * D]'s q and k heads at ``positions`` (cos, sin:
    the model's [max_len, D] tables), k and v written into one layer's cache [hkv, num_blocks,
    block_size, D] at cache ``rows`` (block * block_size + offset; int64 [T], as positions);
    returns q [T, hq, D], or None where the kernel does not apply (nothing is written then)."""
    lib = loader.library()
    if (
        lib is None
        or qkv.dim() != 2
        or not fp32_cpu(qkv, cos, sin, k_cache, v_cache)
        or positions.dtype != torch.int64
        or rows.dtype != torch.int64
        or not positions.is_contiguous()
        or not rows.is_contiguous()
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
        rows.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[2],
        k_cache.shape[1],
        q.data_ptr(),
        loader.threads(),
    )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [T, 2 I] (gate | up): [T, I]; None where the kernel does not apply."""
    lib = loader.library()
    if lib is None or gate_up.dim() != 2 or not fp32_cpu(gate_up):
        return None
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, i, dtype=torch.float32)
    lib.silu_mul_f32(gate_up.data_ptr(), t, i, out.data_ptr(), loader.threads())
    return out


def apply_bitmask(logits: torch.Tensor, rows: np.ndarray, bitmask: np.ndarray) -> bool:
    """Forbid (-inf) the tokens ``bitmask`` row i does not allow in ``logits[rows[i]]``, in place;
    False (nothing done) where the kernel does not apply."""
    lib = loader.library()
    if lib is None or logits.dim() != 2 or not fp32_cpu(logits):
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
        loader.threads(),
    )
    return True


def argmax_rows(
    logits: torch.Tensor, mask: tuple[np.ndarray, np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """(each row's argmax as torch.argmax gives it, whether each row is all -inf) for logits
    [R, V], or None where the kernel does not apply. ``mask`` (logits rows, bitmask rows): those
    rows are read as if the bitmask were applied (``apply_bitmask`` first), unchanged."""
    lib = loader.library()
    if lib is None or logits.dim() != 2 or not fp32_cpu(logits) or logits.shape[1] == 0:
        return None
    masks = _masks_of_rows(logits.shape[0], logits.shape[1], mask)
    if masks is None:
        return None
    best = np.empty(logits.shape[0], dtype=np.int64)
    dead = np.empty(logits.shape[0], dtype=np.bool_)
    mask_of_row, bitmask, width = masks
    lib.argmax_rows_f32(
        logits.data_ptr(),
        logits.shape[0],
        logits.shape[1],
        _pointer(mask_of_row),
        _pointer(bitmask),
        width,
        best.ctypes.data,
        dead.ctypes.data,
        loader.threads(),
    )
    return best, dead


def linear_argmax(
    x: torch.Tensor, weight: Weight, vocab_size: int, mask: tuple[np.ndarray, np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`argmax_rows` of ``linear(x, weight)[:, :vocab_size]`` without making those logits
    (``packed_linear.c``: each tile's sums picked from as they are made), or None where no kernel
    applies (a packed fp32 or int8 weight, fp32 x on the CPU). The same picks, bit for bit."""
    lib = loader.library()
    if (
        lib is None
        or not isinstance(weight, PackedWeight | QuantizedWeight)
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or x.dim() != 2
        or not 0 < vocab_size <= weight.shape[0]
        or x.shape[1] != weight.shape[1]
    ):
        return None
    masks = _masks_of_rows(x.shape[0], vocab_size, mask)
    if masks is None:
        return None
    x = x.contiguous()
    best = np.empty(x.shape[0], dtype=np.int64)
    dead = np.empty(x.shape[0], dtype=np.bool_)
    if not x.shape[0]:
        return best, dead
    mask_of_row, bitmask, width = masks
    rest = (x.shape[0], vocab_size, x.shape[1], _pointer(mask_of_row), _pointer(bitmask), width)
    out = (best.ctypes.data, dead.ctypes.data, loader.threads())
    check = weight.check if isinstance(weight, PackedWeight) else None
    if check is not None and (check.offset or x.shape[0] <= CHECKED_ROWS):
        assert isinstance(weight, PackedWeight)
        if checked_picks(x, weight, rest, out):
            return best, dead
    if isinstance(weight, QuantizedWeight):
        failed = lib.packed_linear_argmax_i8(
            x.data_ptr(), weight.blocks.data_ptr(), weight.scale.data_ptr(), None, *rest, *out
        )
    else:
        failed = lib.packed_linear_argmax_f32(x.data_ptr(), weight.blocks.data_ptr(), None, *rest, *out)
    return None if failed else (best, dead)


def checked_picks(
    x: torch.Tensor, weight: PackedWeight, rest: tuple[int | None, ...], out: tuple[int | None, ...]
) -> bool:
    """``packed_linear_argmax_checked`` (picks from ``weight.check``'s int8 copy, exactly) for
    contiguous ``x``; ``rest`` and ``out``: :func:`linear_argmax`'s rows, sizes and mask arguments
    and its outputs' addresses and threads. Whether it made the picks (else the exact picks must)."""
    check = weight.check
    assert check is not None
    lib = loader.library()
    assert lib is not None
    weights = (weight.blocks.data_ptr(), check.blocks.data_ptr(), check.scale.data_ptr(), check.sums.data_ptr())
    bounds = (check.err[0].data_ptr(), check.err[1].data_ptr(), check.block_err.data_ptr(), check.reach)
    return bool(lib.packed_linear_argmax_checked(x.data_ptr(), *weights, *bounds, *rest, *out) == 0)


def _masks_of_rows(
    num_rows: int, vocab_size: int, mask: tuple[np.ndarray, np.ndarray] | None
) -> tuple[np.ndarray | None, np.ndarray | None, int] | None:
    """The picks' mask arguments of ``mask`` (logits rows, bitmask rows): each row's bitmask row
    or -1, the bitmask, its width; None where its shape does not fit."""
    if mask is None:
        return None, None, 0
    rows, bitmask = np.asarray(mask[0], np.int64), np.ascontiguousarray(mask[1], dtype=np.int32)
    if bitmask.ndim != 2 or bitmask.shape[0] != len(rows) or bitmask.shape[1] * 32 < vocab_size:
        return None
    mask_of_row = np.full(num_rows, -1, dtype=np.int32)
    mask_of_row[rows] = np.arange(len(rows), dtype=np.int32)
    return mask_of_row, bitmask, bitmask.shape[1]


def _pointer(array: np.ndarray | None) -> int | None:
    return None if array is None else array.ctypes.data


def single_tokens(bitmask: np.ndarray, vocab_size: int) -> np.ndarray | None:
    """[R] int64: the one token each bitmask row allows, -1 where it allows any other number (bits
    past ``vocab_size`` counted, a lone one there gives -1); None where the kernel does not apply.
    A row is read up to its second set bit."""
    lib = loader.library()
    if lib is None or bitmask.ndim != 2 or bitmask.shape[1] * 32 < vocab_size:
        return None
    bitmask = np.ascontiguousarray(bitmask, dtype=np.int32)
    out = np.empty(bitmask.shape[0], dtype=np.int64)
    if len(out):
        lib.single_token_rows(bitmask.ctypes.data, bitmask.shape[0], bitmask.shape[1], vocab_size, out.ctypes.data)
    return out


def park_threads() -> None:
    """The kernels' helper threads sleep until the next parallel region instead of spinning
    (``pool.c``): their caller is about to wait, and the host's other processes want the cores.
    Each library loaded has its own pool; none is built for this (a GPU rank's may never be)."""
    for lib in loader.LOADED:
        lib.pool_park()
