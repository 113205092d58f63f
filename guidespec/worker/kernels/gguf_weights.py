"""GGUF's quantized weights kept in their own blocks, for the CPU kernel in ``gguf_linear.c``.

A :class:`GGUFWeight` is an [N, K] weight as N rows of K/32 blocks in one of six kernel
formats. Q4_1, Q5_1 and Q8_0 blocks are used as the file stores them; Q4_0, Q5_0, Q4_K, Q5_K
and Q6_K blocks are rewritten once, exactly (every weight the kernel sees equals
``gguf.quants.dequantize``'s):

- Q4_0 -> Q4_1 with offset -8 d, Q5_0 -> Q5_1 with offset -16 d (fp16 products by powers of
  two: exact);
- Q4_K and Q5_K (256 inputs, a 6-bit scale and min per 32) -> ``Q4F`` and ``Q5F``: per 32
  inputs, the scale d * sc and offset -dmin * m in fp32 (exact products), the same quants;
- Q6_K (256 inputs, an int8 scale per 16) -> ``Q8H``: per 32 inputs, the two scales d * sc in
  fp32 and the 6-bit quants as int8.

A 5-bit block is a 4-bit one's scales and nibbles plus the fifth bits, 4 bytes (bit j: input
j's), as Q5_0/Q5_1 store them. The K-quants' rewritten blocks are a third (Q4_K), a quarter
(Q5_K) and half (Q6_K) larger than the file's (Q5_0's: 24 bytes for 22), a price for one simple
kernel; in return every format is cut at any multiple of 32 inputs, which is all tensor
parallelism needs (``columns``). Other types (F16, F32, the other quants) are not kept:
:func:`from_gguf` returns None and the caller dequantizes them.

Not here: reading the file (``checkpoint.GGUFTensors``), choosing which weights to keep
(``model.py``).
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import torch

from guidespec.worker.kernels import loader

QK = 32  # inputs per kernel block
Q4_1, Q4F, Q8_0, Q8H, Q5_1, Q5F = range(6)  # the kernel's formats (gguf_linear.c: FMT_*)
BLOCK_BYTES = {Q4_1: 20, Q4F: 24, Q8_0: 34, Q8H: 40, Q5_1: 24, Q5F: 28}
FIVE_BIT = (Q5_1, Q5F)  # their blocks: scale, offset, fifth bits (4 bytes), nibbles (16)
SUPPORTED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # GGMLQuantizationType names


class GGUFWeight:
    """An [N, K] weight as ``blocks`` uint8 [N, K/32, block bytes] of kernel format ``fmt``."""

    def __init__(self, blocks: torch.Tensor, fmt: int) -> None:
        assert blocks.dtype == torch.uint8 and blocks.dim() == 3 and blocks.shape[2] == BLOCK_BYTES[fmt]
        self._blocks: torch.Tensor | None = blocks.contiguous()
        self._kernel: KernelLayout | None = None
        self.fmt = fmt
        self.shape = torch.Size((blocks.shape[0], blocks.shape[1] * QK))
        self.dtype = torch.float32
        self.device = torch.device("cpu")

    @property
    def blocks(self) -> torch.Tensor:
        if self._blocks is None:
            raise RuntimeError("this weight keeps only the kernel's layout (release_blocks): cut it before")
        return self._blocks

    def kernel_layout(self) -> KernelLayout:
        """The weight in ``gguf_linear.c``'s layout, made on first use."""
        if self._kernel is None:
            self._kernel = KernelLayout.of(self.blocks, self.fmt)
        return self._kernel

    def release_blocks(self) -> None:
        """Keep only the kernel's layout (a model, once loaded: its cuts and concatenations are
        done), not the same numbers twice."""
        self.kernel_layout()
        self._blocks = None

    def select_rows(self, rows: torch.Tensor | slice) -> GGUFWeight:
        return GGUFWeight(self.blocks[rows], self.fmt)

    def columns(self, k0: int, k1: int) -> GGUFWeight | None:
        """Inputs [k0, k1): None where they do not fall on block boundaries."""
        if k0 % QK or k1 % QK:
            return None
        return GGUFWeight(self.blocks[:, k0 // QK : k1 // QK], self.fmt)

    def padded_rows(self, n: int) -> GGUFWeight:
        """``n`` rows, the ones past N all zero blocks (scale 0: outputs 0)."""
        blocks = torch.zeros(n, *self.blocks.shape[1:], dtype=torch.uint8)
        blocks[: self.shape[0]] = self.blocks
        return GGUFWeight(blocks, self.fmt)

    def dequantize(self, ids: torch.Tensor | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
        """Rows ``ids`` (all where None) in fp32, [*ids.shape, K]: the file's numbers exactly."""
        flat = torch.arange(self.shape[0]) if ids is None else ids.reshape(-1).long().contiguous()
        out = torch.empty(len(flat), self.shape[1], dtype=torch.float32)
        if lib is None:
            out = _dequantize_numpy(self.blocks[flat].numpy(), self.fmt)
        elif len(flat):
            layout = self.kernel_layout()
            lib.gguf_dequantize_rows(
                *layout.pointers(),
                self.fmt,
                flat.data_ptr(),
                len(flat),
                self.shape[1],
                out.data_ptr(),
                loader.threads(),
            )
        shape = (self.shape[0],) if ids is None else tuple(ids.shape)
        return out.view(*shape, self.shape[1])


class KernelLayout:
    """A weight as ``gguf_linear.c`` reads it (that file draws it): each row's quants side by side,
    ``qs`` uint8 [N, nbw, 16 or 32] (5-bit: [N, nbw * 16 + nbw * 4], the nibbles, then the fifth
    bits laid out for the kernel), and its blocks' scales apart, ``s0`` and ``s1`` (the offsets
    of 4-bit formats, Q8H's second scales, None for Q8_0) uint8 [N, nbw * 2 or 4] (fp16 or fp32
    bytes), nbw the row's blocks rounded up to even with a zero block. The same bytes as the
    file's blocks, rearranged: a group of 8 blocks' scales is one vector load, and a 4-bit
    format's whole groups have their quants' 4-byte words interleaved (vector p, word i: block
    i's word p), so that an integer product's lane holds one block."""

    def __init__(self, qs: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor | None) -> None:
        self.qs, self.s0, self.s1 = qs, s0, s1

    @classmethod
    def of(cls, blocks: torch.Tensor, fmt: int) -> KernelLayout:
        n, nb, block_bytes = blocks.shape
        nbw = -(-nb // 2) * 2
        qs_bytes = 16 if fmt in (Q4_1, Q4F, *FIVE_BIT) else 32
        scale_bytes = 2 if fmt in (Q4_1, Q8_0, Q5_1) else 4
        raw = np.ascontiguousarray(blocks.numpy())

        def part(start: int, width: int) -> np.ndarray:
            """Bytes [start, start + width) of each block, [n, nbw, width], the padding block zero:
            copied as the widest words that divide them (numpy's strided copy costs by the element:
            a model's layouts took 0.32 s of a 0.45 s load byte by byte)."""
            word = next(w for w in (4, 2, 1) if (start | width | block_bytes) % w == 0)
            dtype = {4: np.uint32, 2: np.uint16, 1: np.uint8}[word]
            out = np.zeros((n, nbw, width // word), dtype=dtype)
            out[:, :nb] = raw.view(dtype)[:, :, start // word : (start + width) // word]
            return out.view(np.uint8)

        s1 = None if fmt == Q8_0 else torch.from_numpy(part(scale_bytes, scale_bytes).reshape(n, -1))
        quants = part(block_bytes - qs_bytes, qs_bytes)
        if qs_bytes == 16:  # whole groups of 8 blocks interleaved: word p of block i -> vector p, word i
            full = nbw // 8 * 8
            words = quants.view(np.uint32)  # [n, nbw, 4]
            words[:, :full] = words[:, :full].reshape(n, full // 8, 8, 4).transpose(0, 1, 3, 2).reshape(n, full, 4)
        qs = torch.from_numpy(quants.reshape(n, -1))
        if fmt in FIVE_BIT:
            bits = np.unpackbits(part(2 * scale_bytes, 4), axis=2, bitorder="little")
            qs = torch.cat([qs, torch.from_numpy(_fifth_bits_for_kernel(bits))], dim=1)
        return cls(qs, torch.from_numpy(part(0, scale_bytes).reshape(n, -1)), s1)

    def pointers(self) -> tuple[int, int, int | None]:
        return self.qs.data_ptr(), self.s0.data_ptr(), None if self.s1 is None else self.s1.data_ptr()


def concat_rows(parts: Sequence[GGUFWeight]) -> GGUFWeight | None:
    """The parts' rows one after the other, in their format; where the formats differ, in Q8_0
    if every part's numbers are Q8_0's exactly (Q4_0's and Q5_0's blocks beside Q8_0 ones, as
    Gemma 3's q, k and v are in its Q4_K_M file); else None."""
    if len({p.shape[1] for p in parts}) != 1:
        return None
    if len({p.fmt for p in parts}) != 1:
        as_q8 = [as_q8_0(p) for p in parts]
        if any(p is None for p in as_q8):
            return None
        parts = [p for p in as_q8 if p is not None]
    return GGUFWeight(torch.cat([p.blocks for p in parts]), parts[0].fmt)


def as_q8_0(weight: GGUFWeight) -> GGUFWeight | None:
    """The same numbers in Q8_0 blocks (the same fp16 scale d, the quants int8): a Q4_1 or Q5_1
    weight whose every offset is -8 d or -16 d (one made from Q4_0 or Q5_0), or a Q8_0 one;
    None for any other. d * q - c d = d * (q - c) exactly: fp16 d times a small integer."""
    if weight.fmt == Q8_0:
        return weight
    if weight.fmt not in (Q4_1, Q5_1):
        return None
    n, nb, _ = weight.blocks.shape
    flat = weight.blocks.numpy().reshape(n * nb, -1)
    center = 8 if weight.fmt == Q4_1 else 16
    d, m = flat[:, :2].copy().view(np.float16), flat[:, 2:4].copy().view(np.float16)
    if not np.array_equal(m, d * np.float16(-center)):
        return None
    q = (_small_quants(flat, weight.fmt).astype(np.int16) - center).astype(np.int8)
    blocks = np.concatenate([flat[:, :2], q.view(np.uint8)], axis=1)
    return GGUFWeight(torch.from_numpy(np.ascontiguousarray(blocks).reshape(n, nb, BLOCK_BYTES[Q8_0])), Q8_0)


def from_gguf(data: np.ndarray, type_name: str, k: int) -> GGUFWeight | None:
    """The kernel's blocks for a GGUF tensor's raw rows ``data`` uint8 [N, row bytes] of
    ``type_name`` with K = ``k`` inputs; None where the type is not kept as blocks."""
    if type_name not in SUPPORTED_TYPES or k % QK:
        return None
    n = data.shape[0]
    rows = np.array(data, dtype=np.uint8)  # a copy: data may be the file's read-only mapping
    if type_name in ("Q4_1", "Q8_0"):
        fmt, blocks = (Q4_1 if type_name == "Q4_1" else Q8_0), rows
    elif type_name == "Q4_0":
        fmt, blocks = Q4_1, _q4_0_as_q4_1(rows.reshape(-1, 18))
    elif type_name == "Q4_K":
        fmt, blocks = Q4F, _q4_k_as_q4f(rows.reshape(-1, 144))
    elif type_name == "Q5_1":
        fmt, blocks = Q5_1, rows
    elif type_name == "Q5_0":
        fmt, blocks = Q5_1, _q5_0_as_q5_1(rows.reshape(-1, 22))
    elif type_name == "Q5_K":
        fmt, blocks = Q5F, _q5_k_as_q5f(rows.reshape(-1, 176))
    else:
        fmt, blocks = Q8H, _q6_k_as_q8h(rows.reshape(-1, 210))
    return GGUFWeight(torch.from_numpy(np.ascontiguousarray(blocks).reshape(n, k // QK, BLOCK_BYTES[fmt])), fmt)


# ---------------------------------------------------------------- rewriting blocks


def _q4_0_as_q4_1(blocks: np.ndarray) -> np.ndarray:
    d = blocks[:, :2].copy().view(np.float16)
    offset = (d * np.float16(-8)).view(np.uint8)
    return np.concatenate([blocks[:, :2], offset, blocks[:, 2:]], axis=1)


def _q5_0_as_q5_1(blocks: np.ndarray) -> np.ndarray:
    d = blocks[:, :2].copy().view(np.float16)
    offset = (d * np.float16(-16)).view(np.uint8)
    return np.concatenate([blocks[:, :2], offset, blocks[:, 2:]], axis=1)


def _q4_k_as_q4f(blocks: np.ndarray) -> np.ndarray:
    """[B, 144] Q4_K super-blocks -> [B * 8, 24] Q4F blocks (the layout of gguf.quants.Q4_K)."""
    from gguf.quants import Q4_K

    b = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    scale = (d * sc.astype(np.float32)).reshape(b * 8, 1)
    offset = -(dmin * mn.astype(np.float32)).reshape(b * 8, 1)
    # 4 chunks of 32 bytes: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1
    qs = blocks[:, 16:].reshape(b, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 15).reshape(b * 8, 32)
    packed = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([scale.view(np.uint8), offset.view(np.uint8), packed], axis=1)


def _q5_k_as_q5f(blocks: np.ndarray) -> np.ndarray:
    """[B, 176] Q5_K super-blocks -> [B * 8, 28] Q5F blocks (the layout of gguf.quants.Q5_K: its
    scales as Q4_K's, then 32 bytes whose bit s is sub-block s's fifth bits, then Q4_K's nibbles)."""
    from gguf.quants import Q4_K

    b = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    scale = (d * sc.astype(np.float32)).reshape(b * 8, 1)
    offset = -(dmin * mn.astype(np.float32)).reshape(b * 8, 1)
    qs = blocks[:, 48:].reshape(b, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 15).reshape(b * 8, 32)
    packed = q[:, :16] | (q[:, 16:] << 4)
    high = (blocks[:, 16:48].reshape(b, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    qh = np.packbits(high.reshape(b * 8, 32), axis=1, bitorder="little")
    return np.concatenate([scale.view(np.uint8), offset.view(np.uint8), qh, packed], axis=1)


def _fifth_bits_for_kernel(bits: np.ndarray) -> np.ndarray:
    """[N, nbw, 32] fifth bits (block, input) -> [N, nbw * 4] bytes in gguf_linear.c's layout: a
    whole group's byte 4i + k holds block i's inputs 4p + k at bit p and 16 + 4p + k at bit 4 + p;
    each pair after the whole groups, a word of its low halves' bits, then one of its high halves'."""
    n, nbw, _ = bits.shape
    full = nbw // 8 * 8
    # whole groups: (group, block i, half, p, k) -> (group, i, k, bit half * 4 + p)
    grouped = bits[:, :full].reshape(n, full // 8, 8, 2, 4, 4).transpose(0, 1, 2, 5, 3, 4)
    groups = np.packbits(grouped.reshape(n, full // 8, 8, 4, 8), axis=-1, bitorder="little")
    # pairs: (pair, block e, half, j) -> (pair, half, bit e * 16 + j)
    paired = bits[:, full:].reshape(n, (nbw - full) // 2, 2, 2, 16).transpose(0, 1, 3, 2, 4)
    pairs = np.packbits(paired.reshape(n, (nbw - full) // 2, 2, 32), axis=-1, bitorder="little")
    return np.ascontiguousarray(np.concatenate([groups.reshape(n, -1), pairs.reshape(n, -1)], axis=1))


def _q6_k_as_q8h(blocks: np.ndarray) -> np.ndarray:
    """[B, 210] Q6_K super-blocks -> [B * 8, 40] Q8H blocks (the layout of gguf.quants.Q6_K)."""
    b = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    scale = (d * sc).reshape(b * 8, 2)
    low = (ql.reshape(b, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    high = (qh.reshape(b, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low.reshape(b, 8, 32) | (high.reshape(b, 8, 32) << 4)).astype(np.int8) - np.int8(32)
    return np.concatenate([scale.view(np.uint8), q.reshape(b * 8, 32).view(np.uint8)], axis=1)


def _dequantize_numpy(blocks: np.ndarray, fmt: int) -> torch.Tensor:
    """[R, nb, bytes] -> fp32 [R, nb * 32] without the C library (the same sums as the kernel's)."""
    r, nb = blocks.shape[:2]
    flat = blocks.reshape(r * nb, -1)
    if fmt in (Q4_1, Q4F, Q5_1, Q5F):
        width = 2 if fmt in (Q4_1, Q5_1) else 4
        kind = np.float16 if fmt in (Q4_1, Q5_1) else np.float32
        d = flat[:, :width].copy().view(kind).astype(np.float32)
        m = flat[:, width : 2 * width].copy().view(kind).astype(np.float32)
        values = d * _small_quants(flat, fmt).astype(np.float32) + m
    else:
        width = 2 if fmt == Q8_0 else 8
        scale = flat[:, :width].copy().view(np.float16 if fmt == Q8_0 else np.float32).astype(np.float32)
        q = flat[:, width:].copy().view(np.int8).astype(np.float32).reshape(-1, 2, 16)
        values = (scale.reshape(-1, scale.shape[1], 1) * q).reshape(-1, 32)
    return torch.from_numpy(np.ascontiguousarray(values.reshape(r, nb * QK), dtype=np.float32))


def _small_quants(flat: np.ndarray, fmt: int) -> np.ndarray:
    """[B, bytes] blocks of a 4-bit or 5-bit format -> their quants uint8 [B, 32], input order."""
    nibbles = flat[:, -16:]
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=1)
    if fmt in FIVE_BIT:
        width = 2 if fmt == Q5_1 else 4
        q |= np.unpackbits(flat[:, 2 * width : 2 * width + 4], axis=1, bitorder="little") << 4
    return q
