"""The weights the kernels read: fp32 packed in blocks of 16 output rows (:class:`PackedWeight`),
int8 with a scale per row (:class:`QuantizedWeight`), a GGUF file's own blocks (``GGUFWeight``), or
a plain tensor; :func:`pack`, :func:`quantize` and :func:`dense` convert between them."""

from __future__ import annotations

import torch

from guidespec.worker.kernels import loader
from guidespec.worker.kernels.gguf_weights import GGUFWeight

BLOCK = 16  # output rows per packed block (one AVX-512 vector, two AVX2 vectors: vec.h)


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
        # an LM head's int8 copy its greedy picks read (``add_picks_check``), or None
        self.check: PicksCheck | None = None

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
        padded, self.scale = _int8_rows(weight)
        self.blocks = padded.view(-1, BLOCK, k).transpose(1, 2).contiguous()
        self.shape = torch.Size((n, k))
        self.dtype = torch.float32
        self.device = torch.device("cpu")

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        return self.blocks.transpose(1, 2).reshape(-1, k)[:n].float() * self.scale[:n, None]


def _int8_rows(weight: torch.Tensor, levels: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """An [N, K] weight rounded to int8 with one fp32 scale per row (its largest magnitude maps to
    ``levels``): (int8 [ceil(N/16) * 16, K], scale [ceil(N/16) * 16]), both zero past N."""
    n, k = weight.shape
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / levels
    padded = torch.zeros(-(-n // BLOCK) * BLOCK, k, dtype=torch.int8)
    padded[:n] = torch.round(w / scale[:, None]).clamp(-levels, levels).to(torch.int8)
    scales = torch.zeros(padded.shape[0], dtype=torch.float32)
    scales[:n] = scale
    return padded, scales


class PicksCheck:
    """What ``packed_linear_argmax_checked`` (``packed_linear.c``) reads beside a packed fp32 LM
    head to pick rows' tokens exactly from an int8 copy: the weight rounded to int8 with a scale
    per row (``scale``: the row's largest magnitude over ``levels``, the kernel's: 127 as
    :class:`QuantizedWeight` rounds it, 63 with AVX2, whose int16 pair sums then take two groups of
    k's before they are widened) in ``blocks``, laid out for the
    kernel's build (``offset``, the kernel's uint8 inputs' offset where it sums int8 inputs:
    128 with AVX-512 VNNI, 64 with AVX2; [ceil(N/16), K4/4, 16, 4] with each token's weight sum
    times it, ``sums``, K4 = K rounded up to 4; 0: [ceil(N/16), K, 16]); ``err`` [2, ceil(N/16) * 16], per
    token what bounds how far its logit from the copy can be from the fp32 one, per unit of a
    row's ||x||_2 (``err[0]``: the L2 distance of the two weight rows, both fp32 sums' rounding,
    gamma_{K+1} of their L2 norms, and 2^-21 of the copy's for its logit's own roundings) and per
    unit of ||x - x's int8 rounding||_2 (``err[1]``: the copy's L2 norm; the int8 sums round the
    inputs too): Cauchy-Schwarz, rounded up; ``block_err`` [2, ceil(N/16)] each block of 16 tokens'
    largest of both (AMX's looks bound a block at once); ``reach`` the rows' largest L1 norm (no
    sum of an input under 1e37 / reach overflows)."""

    def __init__(self, weight: torch.Tensor, offset: int, levels: int) -> None:
        n, k = weight.shape
        self.offset = offset
        padded, k4 = -(-n // BLOCK) * BLOCK, -(-k // 4) * 4 if offset else k
        q = torch.zeros(padded, k4, dtype=torch.int8)
        self.scale = torch.zeros(padded, dtype=torch.float32)
        # per row: ||w - copy||, ||w||, ||copy|| and ||w||_1, in fp64, a chunk of rows at a time
        # (whole-head fp64 copies made this 1.8-2.0 s of a worker's start on one thread; 0.7-0.9)
        stats = torch.empty(4, n, dtype=torch.float64)
        for start in range(0, n, _CHUNK_ROWS):  # (_CHUNK_ROWS is whole blocks: only the last is padded)
            rows, scale = _int8_rows(weight[start : start + _CHUNK_ROWS], levels)
            q[start : start + rows.shape[0], :k] = rows
            self.scale[start : start + rows.shape[0]] = scale
            w = weight[start : start + _CHUNK_ROWS].float()
            end = start + w.shape[0]
            wd, copy = w.double(), rows[: end - start].double() * scale[: end - start, None].double()
            stats[0, start:end] = (wd - copy).norm(dim=1)
            stats[1, start:end] = wd.norm(dim=1)
            stats[2, start:end] = copy.norm(dim=1)
            stats[3, start:end] = wd.abs().sum(dim=1)
        distance, norm, copy_norm = stats[0], stats[1], stats[2]
        u = 2.0**-24
        gamma = (k + 1) * u / (1 - (k + 1) * u)
        if offset:
            self.blocks = q.view(-1, BLOCK, k4 // 4, 4).transpose(1, 2).contiguous()
            self.sums = q.sum(dim=1, dtype=torch.int32) * offset  # (the uint8 inputs' offset, taken off)
        else:
            self.blocks = q.view(-1, BLOCK, k).transpose(1, 2).contiguous()
            self.sums = torch.zeros(0, dtype=torch.int32)
        bounds = torch.stack([distance + gamma * (norm + copy_norm) + 2.0**-21 * copy_norm, copy_norm * (1 + 2.0**-21)])
        self.err = torch.zeros(2, padded, dtype=torch.float32)
        self.err[:, :n] = torch.nextafter((bounds * (1 + 2.0**-10)).float(), torch.tensor(float("inf")))
        self.block_err = self.err.view(2, -1, BLOCK).amax(dim=2).contiguous()  # [2, blocks]: each block's largest
        self.reach = float(stats[3].max()) * (1 + 2.0**-10)


_CHUNK_ROWS = 4096  # (a multiple of BLOCK)


def add_picks_check(weight: Weight) -> None:
    """Give a packed fp32 LM head the int8 copy its greedy picks read (:class:`PicksCheck`): a
    quarter more memory. Not where a weight is not finite (the bounds would not hold)."""
    lib = loader.library()
    if isinstance(weight, PackedWeight) and weight.check is None and lib is not None:
        dense = weight.unpack()
        if bool(torch.isfinite(dense).all()):
            weight.check = PicksCheck(dense, int(lib.packed_checked_offset()), int(lib.packed_checked_weight_levels()))


Weight = torch.Tensor | PackedWeight | QuantizedWeight | GGUFWeight


def pack(weight: torch.Tensor) -> Weight:
    """The weight packed for :func:`linear` when the kernel applies (fp32, 2-D, on the CPU, a
    compiled kernel), else the weight itself."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu" or loader.library() is None:
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
    return quantized if loader.library() is not None else quantized.dequantize()


def dense(weight: Weight) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize()
    if isinstance(weight, GGUFWeight):
        return weight.dequantize(lib=loader.library())
    return weight.unpack() if isinstance(weight, PackedWeight) else weight
