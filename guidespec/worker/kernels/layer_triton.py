"""A decoder layer's elementwise work as Triton kernels, for bf16 / fp16 models on CUDA.

A decode step of a small model is bound by the number of kernels a CUDA graph replays, not by
their work (SmolLM2-135M's shape on an H200: ~50 kernels a layer, the GPU idle between them).
torch spends 8 kernels on an RMS norm in half precision (upcast, square, mean, add, rsqrt,
multiply, round, scale), 5 on RoPE and 2 on SiLU-and-multiply; each function here is one kernel
doing the same arithmetic in the same order, with the same roundings to the model's dtype
between steps as torch's ops (``model._rms_norm``, ``rotary.apply_rope``, ``F.silu(gate) * up``),
so results differ from torch's only where a sum's order does (the norm's mean of squares) or in
the last bit of an ``exp``. :func:`rope_into_cache` also writes the rotated keys and the values
into the paged cache (the captured step's 2 scatters a layer folded into its RoPE kernel).
With ``TRITON_INTERPRET=1`` they run on CPU tensors (how CI tests
them against torch). Each returns None where it does not apply: torch's ops then run.
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's ops stand in
    triton = None

_HALF = (torch.bfloat16, torch.float16)


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # (read by Triton at import, as here)


def applies(x: torch.Tensor) -> bool:
    """Whether these kernels take ``x``: half precision on CUDA (or any device in the interpreter)."""
    return triton is not None and x.dtype in _HALF and (x.is_cuda or _INTERPRETED)


if triton is not None:

    @triton.jit
    def _add_rms_norm(
        x_ptr,
        delta_ptr,
        weight_ptr,
        sum_ptr,
        norm_ptr,
        x_stride,
        delta_stride,
        hidden,
        eps,
        HAS_DELTA: tl.constexpr,
        ROUND_FIRST: tl.constexpr,  # Llama's weights in the model's dtype: round, then scale
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < hidden
        x = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * delta_stride + cols, mask=inside, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # x + delta, rounded
            tl.store(sum_ptr + row * hidden + cols, x, mask=inside)
        xf = x.to(tl.float32)
        scale = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
        w = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        if ROUND_FIRST:
            out = (xf * scale).to(norm_ptr.dtype.element_ty).to(tl.float32) * w
        else:  # Gemma's fp32 weights: scale in fp32, then round
            out = xf * scale * w
        tl.store(norm_ptr + row * hidden + cols, out.to(norm_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _silu_mul(gate_up_ptr, out_ptr, stride, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < inter
        g = tl.load(gate_up_ptr + row * stride + cols, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + row * stride + inter + cols, mask=inside, other=0.0).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, (silu * u).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _rotated(src, cos_ptr, sin_ptr, token, table_stride, dtype: tl.constexpr, HALF: tl.constexpr):
        """One head at ``src`` rotated by ``token``'s cos, sin: its two halves in ``dtype``:
        x * cos + rotate_half(x) * sin, each product and the sum rounded as torch's ops round them."""
        cols = tl.arange(0, HALF)
        x1 = tl.load(src + cols).to(tl.float32)
        x2 = tl.load(src + HALF + cols).to(tl.float32)
        c1 = tl.load(cos_ptr + token * table_stride + cols).to(tl.float32)
        c2 = tl.load(cos_ptr + token * table_stride + HALF + cols).to(tl.float32)
        s1 = tl.load(sin_ptr + token * table_stride + cols).to(tl.float32)
        s2 = tl.load(sin_ptr + token * table_stride + HALF + cols).to(tl.float32)
        a1, a2 = (x1 * c1).to(dtype).to(tl.float32), (x2 * c2).to(dtype).to(tl.float32)
        b1, b2 = (-x2 * s1).to(dtype).to(tl.float32), (x1 * s2).to(dtype).to(tl.float32)
        return (a1 + b1).to(dtype), (a2 + b2).to(dtype)

    @triton.jit
    def _rope(x_ptr, out_ptr, cos_ptr, sin_ptr, x_stride, head_stride, table_stride, heads, HALF: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        src = x_ptr + token * x_stride + head * head_stride
        r1, r2 = _rotated(src, cos_ptr, sin_ptr, token, table_stride, out_ptr.dtype.element_ty, HALF)
        cols = tl.arange(0, HALF)
        dst = out_ptr + (token * heads + head) * (2 * HALF)
        tl.store(dst + cols, r1)
        tl.store(dst + HALF + cols, r2)

    @triton.jit
    def _rope_write(
        qkv_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        cos_ptr,
        sin_ptr,
        block_ptr,
        offset_ptr,
        qkv_stride,
        table_stride,
        head_stride,  # a cache's stride between kv heads (num_blocks * block_size * D)
        block_size,
        hq,
        hkv,
        HALF: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)  # q heads, then k heads (each with its v head)
        cols = tl.arange(0, HALF)
        src = qkv_ptr + token * qkv_stride + head * (2 * HALF)
        r1, r2 = _rotated(src, cos_ptr, sin_ptr, token, table_stride, q_ptr.dtype.element_ty, HALF)
        if head < hq:
            dst = q_ptr + (token * hq + head) * (2 * HALF)
            tl.store(dst + cols, r1)
            tl.store(dst + HALF + cols, r2)
        else:
            kv_head = head - hq
            row = tl.load(block_ptr + token) * block_size + tl.load(offset_ptr + token)
            at = kv_head.to(tl.int64) * head_stride + row * (2 * HALF)
            tl.store(k_cache_ptr + at + cols, r1)
            tl.store(k_cache_ptr + at + HALF + cols, r2)
            v_src = src + hkv * (2 * HALF)  # this k head's v head: hkv heads further on
            tl.store(v_cache_ptr + at + cols, tl.load(v_src + cols))
            tl.store(v_cache_ptr + at + HALF + cols, tl.load(v_src + HALF + cols))


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + delta, RMS norm of it times ``weight``) for x [T, H] (delta None: x and its norm), one
    kernel; None where it does not apply."""
    if not applies(x) or x.dim() != 2 or x.stride(-1) != 1 or weight.dtype not in (x.dtype, torch.float32):
        return None
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype or delta.stride(-1) != 1):
        return None
    t, hidden = x.shape
    total = x if delta is None else torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    norm = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    if t:
        grid: Any = (t,)
        _add_rms_norm[grid](
            x,
            x if delta is None else delta,
            weight,
            total,
            norm,
            x.stride(0),
            0 if delta is None else delta.stride(0),
            hidden,
            eps,
            HAS_DELTA=delta is not None,
            ROUND_FIRST=weight.dtype == x.dtype,
            BLOCK=triton.next_power_of_2(hidden),
        )
    return total, norm


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [T, 2 I] (gate | up): [T, I], one kernel; None where it does not apply."""
    if not applies(gate_up) or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        return None
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = min(1024, triton.next_power_of_2(inter))
        grid: Any = (t, triton.cdiv(inter, block))
        _silu_mul[grid](gate_up, out, gate_up.stride(0), inter, BLOCK=block)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """``rotary.apply_rope`` of x [T, heads, D] by cos, sin [T, D] (every dim of a head rotated),
    one kernel, into a new contiguous tensor; None where it does not apply."""
    if not applies(x) or x.dim() != 3 or cos.dtype != x.dtype or sin.dtype != x.dtype:
        return None
    t, heads, d = x.shape
    if (
        cos.shape != (t, d)
        or sin.shape != (t, d)
        or x.stride(-1) != 1
        or d % 2
        or (d // 2) & (d // 2 - 1)  # a power of two: tl.arange's length
        or cos.stride() != sin.stride()
        or cos.stride(-1) != 1
    ):
        return None
    out = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    if t:
        grid: Any = (t, heads)
        _rope[grid](x, out, cos, sin, x.stride(0), x.stride(1), cos.stride(0), heads, HALF=d // 2)
    return out


def rope_into_cache(
    qkv: torch.Tensor,
    hq: int,
    hkv: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    where: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor | None:
    """qkv [T, (hq + 2 hkv) D]: q and k rotated by cos, sin [T, D] (``apply_rope``'s roundings), k
    and v written into the caches [hkv, blocks, block_size, D] at ``where`` (``KVCache.locate``'s
    blocks and offsets), one kernel; returns q [T, hq, D]. None where it does not apply."""
    if not applies(qkv) or qkv.dim() != 2 or qkv.stride(-1) != 1 or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
        return None
    t = qkv.shape[0]
    hkv_cache, _, block_size, d = k_cache.shape
    blocks, offsets = where
    if (
        qkv.shape[1] != (hq + 2 * hkv) * d
        or hkv_cache != hkv
        or cos.shape != (t, d)
        or sin.shape != (t, d)
        or cos.stride() != sin.stride()
        or cos.stride(-1) != 1
        or d % 2
        or (d // 2) & (d // 2 - 1)
        or not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == qkv.dtype)
        or blocks.shape != (t,)
        or offsets.shape != (t,)
    ):
        return None
    q = torch.empty((t, hq, d), dtype=qkv.dtype, device=qkv.device)
    if t:
        grid: Any = (t, hq + hkv)
        _rope_write[grid](
            qkv,
            q,
            k_cache,
            v_cache,
            cos,
            sin,
            blocks.contiguous(),
            offsets.contiguous(),
            qkv.stride(0),
            cos.stride(0),
            k_cache.stride(0),
            block_size,
            hq,
            hkv,
            HALF=d // 2,
        )
    return q
