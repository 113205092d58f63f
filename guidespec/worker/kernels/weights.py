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
        # an LM head's int8 copy for a few rows' picks (``add_picks_check``), or None
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


class PicksCheck:
    """What ``packed_linear_argmax_checked`` (``packed_linear.c``) reads beside a packed fp32 LM
    head to pick a few rows' tokens exactly from a quarter of its bytes: the weight as int8
    (``quantized``), and per token the bound ``err`` [ceil(N/16) * 16] on how far its logit from the
    int8 copy can be from the fp32 one per unit of max|x| (the two rows' L1 distance, plus both
    fp32 sums' rounding: gamma_{K+1} of their L1 norms; rounded up), ``reach`` the rows' largest
    L1 norm (no sum of an input under 1e37 / reach overflows)."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        self.quantized = QuantizedWeight(weight)
        w = weight.double()
        q = self.quantized.blocks.transpose(1, 2).reshape(-1, k)[:n].double()
        distance = (w - q * self.quantized.scale[:n, None].double()).abs().sum(dim=1)
        norm = w.abs().sum(dim=1)
        u = 2.0**-24
        gamma = (k + 1) * u / (1 - (k + 1) * u)
        bound = (distance + gamma * (2 * norm + distance)) * (1 + 2.0**-10)
        self.err = torch.zeros(self.quantized.scale.shape[0], dtype=torch.float32)
        self.err[:n] = torch.nextafter(bound.float(), torch.tensor(float("inf")))
        self.reach = float(norm.max()) * (1 + 2.0**-10)


def add_picks_check(weight: Weight) -> None:
    """Give a packed fp32 LM head the int8 copy its few-row picks read (:class:`PicksCheck`): a
    quarter more memory. Not where a weight is not finite (the bound would not hold)."""
    if isinstance(weight, PackedWeight) and weight.check is None:
        dense = weight.unpack()
        if bool(torch.isfinite(dense).all()):
            weight.check = PicksCheck(dense)


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
