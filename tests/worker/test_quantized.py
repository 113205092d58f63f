"""GGUF's quantized weights kept as blocks (kernels/gguf_weights.py, gguf_linear.c).

Tolerances: a weight's numbers equal ``gguf.quants.dequantize``'s exactly; the kernel equals an
exact emulation of its arithmetic (activations rounded to int8 per 32 inputs, as llama.cpp's
Q8 dot products do) within 1e-4; against the fp32 product with the dequantized weight it is
within 2% relative error (the int8 rounding of activations: ~0.5% on random data).
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from guidespec.worker import kernels
from guidespec.worker.kernels import gguf_weights
from guidespec.worker.kernels.gguf_weights import GGUFWeight, from_gguf

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the kernel is not built")

FORMATS = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]


def quantized_rows(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF rows uint8 [n, row bytes] of a random weight: quantized by the gguf package where
    it can (Q4_0, Q4_1, Q8_0), else random blocks built from the spec with sane fp16 scales."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name not in ("Q4_K", "Q6_K"):
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.1, qtype)
    size, scale_at = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}[type_name]
    raw = rng.integers(0, 256, (n * k // 256, size), dtype=np.uint8)
    for at in scale_at:  # Q4_K: d and dmin; Q6_K: d (the rest of a block is any bits)
        raw[:, at : at + 2] = (rng.random((len(raw), 1)) * 0.01).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def dequantized(raw: np.ndarray, type_name: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).copy())


def emulated_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel's sums done exactly: x rounded to int8 per 32 inputs (scale max|x| / 127)."""
    blocks = x.view(x.shape[0], x.shape[1] // 32, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127  # fp32 as in C: d, 1 / d, then x * (1 / d)
    q = torch.round(blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
    return ((q.double() * d.double()).view_as(x) @ w.double().T).float()


@pytest.mark.parametrize("type_name", FORMATS)
def test_blocks_hold_the_files_numbers_exactly(type_name: str) -> None:
    raw = quantized_rows(type_name, 40, 512)
    weight = from_gguf(raw, type_name, 512)
    assert weight is not None and weight.shape == (40, 512)
    reference = dequantized(raw, type_name)
    assert torch.equal(kernels.dense(weight), reference)
    assert torch.equal(weight.dequantize(), reference)  # numpy, without the C library
    ids = torch.tensor([[3, 0], [39, 3]])
    assert torch.equal(kernels.embedding(ids, weight), reference[ids])


@pytest.mark.parametrize("type_name", FORMATS)
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 9, 70])
def test_kernel_matches_the_dequantized_weight(type_name: str, m: int) -> None:
    n, k = 37, 768
    raw = quantized_rows(type_name, n, k, seed=m)
    weight = from_gguf(raw, type_name, k)
    assert weight is not None
    w = dequantized(raw, type_name)
    g = torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    out = kernels.linear(x, weight, bias)
    torch.testing.assert_close(out, emulated_linear(x, w) + bias, atol=1e-4, rtol=1e-4)
    if m:
        exact = F.linear(x, w)
        assert float((out - bias - exact).norm() / exact.norm()) < 0.02


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    weight = from_gguf(quantized_rows("Q4_1", 100, 576), "Q4_1", 576)
    assert weight is not None
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(0))
    alone = torch.cat([kernels.linear(x[i : i + 1], weight) for i in range(len(x))])
    assert torch.equal(kernels.linear(x, weight), alone)


def test_cuts_fall_on_blocks_and_rows_concatenate() -> None:
    raw = quantized_rows("Q4_K", 20, 768)
    weight = from_gguf(raw, "Q4_K", 768)
    assert weight is not None
    w = dequantized(raw, "Q4_K")
    left = weight.columns(0, 416)  # not a multiple of 256: fine once the K-quants are in 32s
    assert left is not None and torch.equal(kernels.dense(left), w[:, :416])
    assert weight.columns(0, 100) is None
    rows = gguf_weights.concat_rows([weight.select_rows(slice(5, 9)), weight.select_rows(torch.tensor([0, 19]))])
    assert rows is not None and torch.equal(kernels.dense(rows), w[[5, 6, 7, 8, 0, 19]])
    padded = weight.padded_rows(24)
    assert torch.equal(kernels.dense(padded)[20:], torch.zeros(4, 768))
    other = from_gguf(quantized_rows("Q8_0", 3, 768), "Q8_0", 768)
    assert other is not None and gguf_weights.concat_rows([weight, other]) is None


def test_types_not_kept_as_blocks() -> None:
    assert from_gguf(np.zeros((4, 64), dtype=np.uint8), "F16", 32) is None
    assert from_gguf(np.zeros((4, 20), dtype=np.uint8), "Q4_1", 32) is not None
    assert isinstance(from_gguf(np.zeros((4, 20), dtype=np.uint8), "Q4_1", 32), GGUFWeight)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 instruction sets")
@pytest.mark.parametrize("arch,flag", [
    ("-march=x86-64", "sse2"),  # the portable C tile
    ("-march=x86-64-v3", "avx2"),  # AVX2: maddubs
    ("-march=x86-64-v4", "avx512f"),  # AVX-512 without VNNI: maddubs
    ("-march=native", "avx512_vnni"),  # dpbusd where this CPU has it
])
def test_each_instruction_set_builds_and_matches(monkeypatch: pytest.MonkeyPatch, arch: str, flag: str) -> None:
    path = kernels.build([arch])
    assert path is not None and path.exists()
    if flag not in open("/proc/cpuinfo").read():
        return
    monkeypatch.setattr(kernels, "_library", lambda: kernels.load(path))
    for type_name in FORMATS:
        raw = quantized_rows(type_name, 19, 512)
        weight = from_gguf(raw, type_name, 512)
        assert weight is not None
        x = torch.randn(6, 512, generator=torch.Generator().manual_seed(1))
        w = dequantized(raw, type_name)
        assert torch.equal(kernels.dense(weight), w)
        torch.testing.assert_close(kernels.linear(x, weight), emulated_linear(x, w), atol=1e-4, rtol=1e-4)
