"""A decoder layer's elementwise work as Triton kernels, for bf16 / fp16 models on CUDA.

A decode step of a small model is bound by the number of kernels a CUDA graph replays, not by
their work (SmolLM2-135M's shape on an H200: ~50 kernels a layer, the GPU idle between them).
torch spends 8 kernels on an RMS norm in half precision (upcast, square, mean, add, rsqrt,
multiply, round, scale), 5 on RoPE and 2 on SiLU-and-multiply; each function here is one kernel
doing the same arithmetic in the same order, with the same roundings to the model's dtype
between steps as torch's ops (``model._rms_norm``, ``rotary.apply_rope``, ``F.silu(gate) * up``),
so results differ from torch's only where a sum's order does (the norm's mean of squares) or in
the last bit of an ``exp``. With ``TRITON_INTERPRET=1`` they run on CPU tensors (how CI tests
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
    def _rope(x_ptr, out_ptr, cos_ptr, sin_ptr, x_stride, head_stride, table_stride, heads, HALF: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        cols = tl.arange(0, HALF)
        src = x_ptr + token * x_stride + head * head_stride
        x1 = tl.load(src + cols).to(tl.float32)
        x2 = tl.load(src + HALF + cols).to(tl.float32)
        c1 = tl.load(cos_ptr + token * table_stride + cols).to(tl.float32)
        c2 = tl.load(cos_ptr + token * table_stride + HALF + cols).to(tl.float32)
        s1 = tl.load(sin_ptr + token * table_stride + cols).to(tl.float32)
        s2 = tl.load(sin_ptr + token * table_stride + HALF + cols).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        # x * cos + rotate_half(x) * sin, each product and the sum rounded as torch's ops round them
        a1, a2 = (x1 * c1).to(dtype).to(tl.float32), (x2 * c2).to(dtype).to(tl.float32)
        b1, b2 = (-x2 * s1).to(dtype).to(tl.float32), (x1 * s2).to(dtype).to(tl.float32)
        dst = out_ptr + (token * heads + head) * (2 * HALF)
        tl.store(dst + cols, (a1 + b1).to(dtype))
        tl.store(dst + HALF + cols, (a2 + b2).to(dtype))


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
