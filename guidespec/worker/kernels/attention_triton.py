"""Attention over the paged KV cache as one Triton kernel, for bf16 / fp16 models on CUDA.

A captured decode or verify step (``LlamaModel.forward_padded``) attended by gathering every
row's blocks into a dense [B, kv_heads, L, D] copy of its keys and values (one kernel each),
permuting the queries, and running SDPA with an additive mask over all ``L`` keys of the step's
bucket: five kernels or more a layer, and a copy of the whole bucket's keys whatever the rows'
real lengths. Here one program per (row, key/value head) reads the row's keys in place through
its block table, only up to its newest query's position, with the query heads that share the
key/value head stacked on the query axis (grouped-query attention without repeated keys), and
an online softmax in fp32 (the flash-attention recurrence); queries are read from the rotated
[T, heads, D] layout and the output written as the o projection reads it.

Each query attends the keys at positions <= its own (and > its own - window where the layer has
a window). Results equal SDPA's to rounding (the probabilities are rounded to the model's dtype
before they weight the values, as flash attention does). With ``TRITON_INTERPRET=1`` it runs on
CPU tensors (how CI tests it against torch).
"""

from __future__ import annotations

from typing import Any

import torch

from guidespec.worker.kernels.layer_triton import applies, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _paged_attention(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        positions_ptr,
        out_ptr,
        q_stride,
        out_stride,
        table_stride,
        head_stride,  # a cache's stride between kv heads
        n,  # tokens per row
        key_length,
        window,
        scale,
        G: tl.constexpr,  # query heads per kv head
        D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # positions per cache block
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        m = tl.arange(0, BLOCK_M)  # (query head in the group, token of the row)
        real = m < G * n
        token = row * n + m % n
        head = kv_head * G + m // n
        dims = tl.arange(0, D)
        at_q = token[:, None] * q_stride + head[:, None] * D + dims[None, :]
        q = tl.load(q_ptr + at_q, mask=real[:, None], other=0.0)
        pos = tl.load(positions_ptr + token, mask=real, other=0)
        end = tl.minimum(tl.max(tl.where(real, pos, 0), axis=0) + 1, key_length)
        start = 0
        if HAS_WINDOW:  # the blocks before every query's window are skipped
            first = tl.min(tl.where(real, pos, end), axis=0) - window + 1
            start = tl.maximum(first, 0) // BLOCK_N * BLOCK_N
        base = kv_head.to(tl.int64) * head_stride
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        top = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # finite: a row without keys yet stays 0
        total = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for key0 in range(start, end, BLOCK_N):
            keys = key0 + tl.arange(0, BLOCK_N)
            inside = keys < end
            block = tl.load(tables_ptr + row * table_stride + keys // BLOCK_SIZE, mask=inside, other=0).to(tl.int64)
            at = base + (block * BLOCK_SIZE + keys % BLOCK_SIZE)[:, None] * D + dims[None, :]
            k = tl.load(k_ptr + at, mask=inside[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_N], fp32
            allowed = (keys[None, :] <= pos[:, None]) & inside[None, :]
            if HAS_WINDOW:
                allowed = allowed & (keys[None, :] > pos[:, None] - window)
            scores = tl.where(allowed, scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=1))
            shrink = tl.exp(top - new_top)
            p = tl.exp(scores - new_top[:, None])
            total = total * shrink + tl.sum(p, axis=1)
            v = tl.load(v_ptr + at, mask=inside[:, None], other=0.0)
            acc = acc * shrink[:, None] + tl.dot(p.to(v.dtype), v)
            top = new_top
        out = acc / total[:, None]
        dst = out_ptr + token[:, None] * out_stride + head[:, None] * D + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=real[:, None])


_MAX_QUERIES = 128  # query heads per kv head x tokens per row that one program holds


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    tokens_per_row: int,
    key_length: int,
    window: int | None = None,
) -> torch.Tensor | None:
    """Attention of q [B * n, hq, D] (row b's n tokens at b * n.., rotated) over the caches
    [hkv, blocks, block_size, D] through ``tables`` [B, >= key_length / block_size] (the rows'
    blocks), each query seeing the keys up to its position in ``positions`` [B * n] (and within
    ``window``), at most ``key_length`` keys: [B * n, hq * D]. None where it does not apply
    (torch's gather and SDPA then run)."""
    if not applies(q) or triton is None or q.dim() != 3 or k_cache.dim() != 4:
        return None
    t, hq, d = q.shape
    hkv, _, block_size, _ = k_cache.shape
    n = tokens_per_row
    g = hq // hkv if hkv else 0
    b = tables.shape[0]
    if (
        g * hkv != hq
        or n < 1
        or b * n != t
        or g * n > _MAX_QUERIES
        or d < 16
        or d & (d - 1)
        or k_cache.shape[-1] != d
        or q.stride(2) != 1
        or q.stride(1) != d
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or k_cache.dtype != q.dtype
        or v_cache.dtype != q.dtype
        or tables.dim() != 2
        or tables.stride(1) != 1
        or positions.shape != (t,)
        or tables.shape[1] * block_size < key_length
    ):
        return None
    out = torch.empty((t, hq * d), dtype=q.dtype, device=q.device)
    if t:
        grid: Any = (b, hkv)
        _paged_attention[grid](
            q,
            k_cache,
            v_cache,
            tables,
            positions,
            out,
            q.stride(0),
            out.stride(0),
            tables.stride(0),
            k_cache.stride(0),
            n,
            key_length,
            window or 0,
            d**-0.5,
            G=g,
            D=d,
            BLOCK_SIZE=block_size,
            BLOCK_M=max(16, triton.next_power_of_2(g * n)),
            BLOCK_N=64,
            HAS_WINDOW=window is not None,
        )
    return out
