"""GGUF's quantized weights kept as blocks (kernels/gguf_weights.py, gguf_linear.c).

Tolerances: a weight's numbers equal ``gguf.quants.dequantize``'s exactly; the kernel equals an
exact emulation of its arithmetic (activations rounded to int8 per 32 inputs, as llama.cpp's
Q8 dot products do) within 1e-4; against the fp32 product with the dequantized weight it is
within 2% relative error (the int8 rounding of activations: ~0.5% on random data).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from guidespec.config import ModelConfig
from guidespec.worker import checkpoint, kernels
from guidespec.model_files import load_hf_config
from guidespec.worker.checkpoint import GGUFTensors, ShardReader, gguf_source
from guidespec.worker.kernels import gguf_weights
from guidespec.worker.kernels.gguf_weights import GGUFWeight, from_gguf
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.model import LINEAR_WEIGHTS, LlamaModel
from guidespec.worker.tp import TPInfo, destroy_distributed, init_distributed
from tests.worker.builds import build_for

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the kernel is not built")

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def quantized_rows(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF rows uint8 [n, row bytes] of a random weight: quantized by the gguf package where
    it can (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), else random blocks built from the spec with sane fp16 scales."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    if not type_name.endswith("_K"):
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.1, qtype)
    size, scale_at = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}[type_name]
    raw = rng.integers(0, 256, (n * k // 256, size), dtype=np.uint8)
    for at in scale_at:  # Q4_K, Q5_K: d and dmin; Q6_K: d (the rest of a block is any bits)
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
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 8, 9, 70])
# 24 blocks: 3 groups of 8; 20 (Gemma 3 270M's width): 2 groups and 2 pairs; 14: a group and 3 pairs;
# 9: a group, a pair and a padding block; 7: a group, its last block padding
@pytest.mark.parametrize("k", [768, 640, 448, 288, 224])
def test_kernel_matches_the_dequantized_weight(type_name: str, m: int, k: int) -> None:
    n, whole = 37, -(-k // 256) * 256  # the K-quants come in 256s: cut as tensor parallelism does
    raw = quantized_rows(type_name, n, whole, seed=m)
    full = from_gguf(raw, type_name, whole)
    weight = None if full is None else full.columns(0, k)
    assert weight is not None
    w = dequantized(raw, type_name)[:, :k]
    g = torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    out = kernels.linear(x, weight, bias)
    torch.testing.assert_close(out, emulated_linear(x, w) + bias, atol=1e-4, rtol=1e-4)
    if m:
        exact = F.linear(x, w)
        assert float((out - bias - exact).norm() / exact.norm()) < 0.02


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    """Bit for bit, whatever shares the call (a decode row beside a prefill chunk of 100 rows):
    speculative greedy output equals plain greedy output only if it does. (Dequantizing and
    running fp32 GEMM for large calls was faster for prefill, 4.88 against 6.66 ms at 256 rows of
    576 x 1536, and gave up exactly this.)"""
    weight = from_gguf(quantized_rows("Q4_1", 100, 576), "Q4_1", 576)
    assert weight is not None
    x = torch.randn(111, 576, generator=torch.Generator().manual_seed(0))
    alone = torch.cat([kernels.linear(x[i : i + 1], weight) for i in range(len(x))])
    assert torch.equal(kernels.linear(x, weight), alone)


@pytest.mark.parametrize("type_name", FORMATS)
def test_chosen_rows_equal_the_full_products_columns_bit_for_bit(type_name: str) -> None:
    """The LM head over the tokens a grammar allows (kernels.linear_rows): each value is the one
    the whole product gives, so greedy picks do not change."""
    raw = quantized_rows(type_name, 300, 768)
    weight = from_gguf(raw, type_name, 768)
    assert weight is not None
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(5))
    ids = np.array([299, 0, 17, 18, 150, 17], dtype=np.int32)  # any order, repeats
    chosen = kernels.linear_rows(x, weight, ids)
    assert chosen is not None and torch.equal(chosen, kernels.linear(x, weight)[:, ids])
    empty = kernels.linear_rows(x, weight, np.zeros(0, dtype=np.int32))
    assert empty is not None and empty.shape == (3, 0)
    with pytest.raises(IndexError):
        kernels.linear_rows(x, weight, np.array([300], dtype=np.int32))


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


def test_parts_whose_numbers_are_q8_0s_concatenate_as_q8_0() -> None:
    """Gemma 3's Q4_K_M file keeps q and k in Q5_0 and v in Q8_0: one fused weight in Q8_0, the
    same numbers; a Q5_1 or Q4_K part (offsets of their own) does not fuse with Q8_0."""
    raws, parts = {}, {}
    for seed, name in enumerate(["Q5_0", "Q4_0", "Q8_0", "Q5_1", "Q4_K"]):
        raws[name] = quantized_rows(name, 7, 512, seed=seed)
        weight = from_gguf(raws[name], name, 512)
        assert weight is not None
        parts[name] = weight
    fused = gguf_weights.concat_rows([parts["Q5_0"], parts["Q4_0"], parts["Q8_0"]])
    assert fused is not None and fused.fmt == gguf_weights.Q8_0
    w = torch.cat([dequantized(raws[name], name) for name in ("Q5_0", "Q4_0", "Q8_0")])
    assert torch.equal(kernels.dense(fused), w)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(kernels.linear(x, fused), emulated_linear(x, w), atol=1e-4, rtol=1e-4)
    assert gguf_weights.concat_rows([parts["Q5_1"], parts["Q8_0"]]) is None
    assert gguf_weights.concat_rows([parts["Q4_K"], parts["Q8_0"]]) is None


def test_types_not_kept_as_blocks() -> None:
    assert from_gguf(np.zeros((4, 64), dtype=np.uint8), "F16", 32) is None
    assert from_gguf(np.zeros((4, 20), dtype=np.uint8), "Q4_1", 32) is not None
    assert isinstance(from_gguf(np.zeros((4, 20), dtype=np.uint8), "Q4_1", 32), GGUFWeight)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 instruction sets")
@pytest.mark.parametrize(
    "arch,flag",
    [
        ("-march=x86-64", "sse2"),  # the portable C tile
        ("-march=x86-64-v3", "avx2"),  # AVX2: maddubs
        ("-march=x86-64-v4", "avx512f"),  # AVX-512 without VNNI: maddubs
        ("-march=native", "avx512_vnni"),  # dpbusd where this CPU has it
    ],
)
def test_each_instruction_set_builds_and_matches(monkeypatch: pytest.MonkeyPatch, arch: str, flag: str) -> None:
    path = build_for(arch)
    assert path is not None and path.exists()
    if flag not in open("/proc/cpuinfo").read().split():
        pytest.skip(f"built with {arch}; this CPU lacks {flag} to run it")
    monkeypatch.setattr(kernels.loader, "library", lambda: kernels.load(path))
    for type_name in FORMATS:
        raw = quantized_rows(type_name, 19, 768)
        for k in (512, 640):  # whole groups; 2 groups and 2 pairs (cut as tensor parallelism cuts)
            weight = from_gguf(raw, type_name, 768)
            weight = None if weight is None else weight.columns(0, k)
            assert weight is not None
            x = torch.randn(40, k, generator=torch.Generator().manual_seed(1))  # tiles of 16, 16 and 8 rows
            w = dequantized(raw, type_name)[:, :k]
            assert torch.equal(kernels.dense(weight), w)
            torch.testing.assert_close(kernels.linear(x, weight), emulated_linear(x, w), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(
    platform.machine() != "x86_64" or "avx512_vnni" not in open("/proc/cpuinfo").read(), reason="a CPU with VNNI"
)
def test_vnni_products_give_the_maddubs_kernels_results_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """dpbusd sums a block's products in int32 as the maddubs tree does (which never saturates
    there), and 512-bit products of two rows at once (a 4-bit format's groups, 2 rows or more;
    an odd count padded) add each row's lanes in the same order: the same bits for every format,
    tile size and row count, so no output moves with the CPU's ISA. 576 inputs end in a pair of
    blocks outside the whole groups (the default model's width)."""
    results = []
    for arch in ("-march=x86-64-v4", "-march=native"):  # maddubs, then dpbusd (and 512-bit pairs)
        path = build_for(arch)
        assert path is not None
        monkeypatch.setattr(kernels.loader, "library", lambda path=path: kernels.load(path))
        outs = []
        for k in (512, 576):
            x = torch.randn(41, k, generator=torch.Generator().manual_seed(2))
            for type_name in FORMATS:
                if k % (256 if type_name.endswith("_K") else 32):  # (K-quants: super-blocks of 256)
                    continue
                weight = from_gguf(quantized_rows(type_name, 37, k), type_name, k)
                assert weight is not None
                outs += [kernels.linear(x[:m], weight) for m in (1, 2, 4, 5, 17, 41)]
        results.append(outs)
    assert len(results[0]) == len(results[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*results))


# ---------------------------------------------------------------- a tiny model written as a GGUF file

TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    vocab_size=300,
    rms_norm_eps=1e-5,
)
# 3 key/value heads over 2 ranks, 2 + 1 (TINY's 2 heads give o_proj's columns a cut at 128: off Q4_K's 256)
TINY_ODD_HEADS = dict(TINY, hidden_size=384, num_attention_heads=6, num_key_value_heads=3)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], [201, 7, 7, 9, 100]]


def gguf_model(folder: Path, types: dict[str, str], config: dict[str, Any] = TINY) -> Path:
    """A random Llama written as a GGUF file, each 2-D tensor in ``types[its short name]`` (or
    ``types["*"]``), and the Hugging Face folder a conversion of that file gives: the file's
    numbers, the rows of q and k back in Hugging Face order, and ``DONE`` naming the file."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf_config = LlamaConfig(**config)
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).state_dict()
    state.pop("lm_head.weight", None)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(folder / "tiny.gguf", "llama")
    for seed, (name, tensor) in enumerate(state.items()):
        gguf_name = names.get_name(name.removesuffix(".weight"))
        short = gguf_name.rsplit(".", 1)[-1]
        if tensor.dim() == 1:
            writer.add_tensor(gguf_name + ".weight", tensor.numpy())
            continue
        type_name = types.get(short, types["*"])
        raw = quantized_rows(type_name, tensor.shape[0], tensor.shape[1], seed=seed)
        state[name] = dequantized(raw, type_name)
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}.get(short)
        if heads is not None:  # llama.cpp's convert_hf_to_gguf permutes q and k rows for its rotary layout
            n = tensor.shape[0]
            raw = raw[np.arange(n).reshape(heads, 2, n // heads // 2).swapaxes(1, 2).reshape(-1)]
        writer.add_tensor(gguf_name + ".weight", raw, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hf_dir = folder / "converted"
    hf_config.save_pretrained(hf_dir)
    save_file({k: v.contiguous() for k, v in state.items()}, str(hf_dir / "model.safetensors"))
    (hf_dir / "DONE").write_text(json.dumps({"source": str(folder / "tiny.gguf")}))
    return hf_dir


def model_logits(model_dir: Path, quantized: bool, tp: TPInfo = TPInfo()) -> tuple[list[torch.Tensor] | None, Any]:
    """Every position's logits of PROMPTS (a prefill, then the prompts' last tokens batched)."""
    hf = load_hf_config(model_dir)
    model = LlamaModel(ModelConfig.from_hf(hf), tp, torch.float32, max_model_len=64, quantized=quantized)
    model.load(model_dir, hf, show_progress=False)
    kv = model.create_kv_cache(len(PROMPTS))
    first = ForwardBatch.create(
        [t for p in PROMPTS for t in p[:-1]],
        [0, 1, 2],
        [0, 0, 0],
        [len(p) - 1 for p in PROMPTS],
        [len(p) - 1 for p in PROMPTS],
    )
    a = model.compute_logits(model.forward(first, kv))
    b = model.compute_logits(
        model.forward(
            ForwardBatch.create(
                [p[-1] for p in PROMPTS], [0, 1, 2], [len(p) - 1 for p in PROMPTS], [1, 1, 1], [1, 1, 1]
            ),
            kv,
        )
    )
    if a is None or b is None:
        return None, model
    out, at = [], 0
    for i, p in enumerate(PROMPTS):
        out.append(torch.cat([a[at : at + len(p) - 1], b[i : i + 1]]))
        at += len(p) - 1
    return out, model


def assert_near(ours: list[torch.Tensor], reference: list[torch.Tensor], relative: float) -> None:
    """Each prompt's logits within ``relative`` error (Frobenius norm of the difference over the reference's)."""
    for a, b in zip(ours, reference):
        assert float((a - b).norm() / b.norm()) <= relative, float((a - b).norm() / b.norm())


@pytest.mark.parametrize("type_name", FORMATS)
def test_a_gguf_model_loads_its_blocks_and_matches_its_fp32_weights(tmp_path: Path, type_name: str) -> None:
    """Loaded both ways: the same logits within 5% relative error (int8 activations through two
    random layers: 0.03% to 3% measured), the same greedy choice at 12 of 15 positions or more (a
    random model's logits lie close together), and the blocks kept."""
    folder = gguf_model(tmp_path, {"*": type_name})
    ours, model = model_logits(folder, quantized=True)
    reference, fp32_model = model_logits(folder, quantized=False)
    assert ours is not None and reference is not None
    assert isinstance(model.layers[1]["gate_up"], GGUFWeight) and isinstance(model.lm_head, GGUFWeight)
    assert not model.dequantized and isinstance(fp32_model.layers[1]["gate_up"], kernels.PackedWeight)
    assert_near(ours, reference, 0.05)
    same = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ours, reference))
    assert same >= sum(map(len, PROMPTS)) - 3
    ids = torch.tensor([0, 299, 17])  # the embedding's rows are the file's numbers exactly
    assert torch.equal(kernels.embedding(ids, model.embed), kernels.embedding(ids, fp32_model.embed))


def test_parts_in_different_formats_run_in_fp32(tmp_path: Path) -> None:
    folder = gguf_model(tmp_path, {"*": "Q4_K", "attn_v": "Q6_K"})  # q|k|v fuse into one weight: not here
    ours, model = model_logits(folder, quantized=True)
    reference, _ = model_logits(folder, quantized=False)
    assert ours is not None and reference is not None
    assert isinstance(model.layers[0]["qkv"], kernels.PackedWeight) and isinstance(model.layers[0]["o"], GGUFWeight)
    assert len(model.dequantized) == 2  # each layer's qkv
    assert_near(ours, reference, 0.05)


def test_real_model_blocks_are_the_converted_weights(real_model_dir: Path) -> None:
    """The default GGUF's blocks, q and k rows reordered, are transformers' conversion exactly."""
    source = gguf_source(real_model_dir)
    assert source is not None
    blocks, reader = GGUFTensors(source, 9, 3), ShardReader(real_model_dir)
    for name in (
        "model.layers.7.self_attn.q_proj.weight",
        "model.layers.7.self_attn.k_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
    ):
        weight = blocks.get(name)
        assert weight is not None and torch.equal(kernels.dense(weight), reader.get(name))
    cut = blocks.get("model.layers.0.mlp.down_proj.weight", rows=(8, 40), cols=(768, 1536))
    assert cut is not None
    assert torch.equal(kernels.dense(cut), reader.get("model.layers.0.mlp.down_proj.weight", (8, 40), (768, 1536)))
    assert blocks.get("model.norm.weight") is None  # 1-D, F32 in the file


def _tp_rank(rank: int, folder: Path, init: str, out: Path) -> None:
    init_distributed(TPInfo(rank, 2), init)
    try:
        logits, model = model_logits(folder, quantized=True, tp=TPInfo(rank, 2))
        kept = {key: type(value).__name__ for key, value in model.layers[0].items() if key in LINEAR_WEIGHTS}
        torch.save((logits, kept), out.with_suffix(f".{rank}.pt"))
    finally:
        destroy_distributed()


@pytest.mark.parametrize("type_name,config", [("Q4_1", TINY_ODD_HEADS), ("Q5_0", TINY_ODD_HEADS), ("Q4_K", TINY)])
def test_tp2_with_blocks_equals_tp1(tmp_path: Path, type_name: str, config: dict[str, Any]) -> None:
    """Two ranks over gloo, each with its cut of the blocks (Q4_K: o_proj's columns cut at 128,
    inside a 256-input super-block, which the 32-input rewrite allows; Q5_0: a rank's o_proj of 8
    blocks, a whole group of fifth bits, the other's of 4, two pairs), give TP=1's logits: the
    fp32 sums across ranks are ordered differently, so a prompt's logits are TP=1's within 1e-4
    relative error unless a sum lands on the other side of an int8 activation's rounding (a prompt
    in ~6 here: 2e-3 to 4e-3, measured over 4 weight seeds; a wrong cut is off by the logits' own
    size). Every prompt within 2e-2, one or more within 1e-4."""
    from guidespec.launch.launcher import _free_port

    folder = gguf_model(tmp_path, {"*": type_name}, config)
    out = tmp_path / "logits"
    mp.start_processes(_tp_rank, args=(folder, f"tcp://127.0.0.1:{_free_port()}", out), nprocs=2, start_method="spawn")
    (ours, kept), (none, _) = torch.load(out.with_suffix(".0.pt")), torch.load(out.with_suffix(".1.pt"))
    assert none is None and set(kept.values()) == {"GGUFWeight"}
    reference, _ = model_logits(folder, quantized=True)
    assert reference is not None
    assert_near(ours, reference, 2e-2)
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(ours, reference)]
    assert min(errors) <= 1e-4, errors


def test_a_mask_of_few_tokens_gets_the_whole_heads_logits_for_them(tmp_path: Path) -> None:
    """The worker's LM head over only the tokens a row's mask allows (a quarter of the vocabulary
    or fewer) gives what the whole head gives, masked: a forced row, a few-token row and an
    all-allowed row in one step, beside an unguided row."""
    from types import SimpleNamespace

    from guidespec.worker.mask import DeviceMasks, apply_bitmask
    from guidespec.worker.worker import Worker

    folder = gguf_model(tmp_path, {"*": "Q4_1"})
    hf = load_hf_config(folder)
    model = LlamaModel(ModelConfig.from_hf(hf), TPInfo(), torch.float32, max_model_len=64, quantized=True)
    model.load(folder, hf, show_progress=False)
    assert model.computes_chosen_logits
    words = -(-model.cfg.vocab_size // 32)
    bitmask = np.zeros((3, words), dtype=np.int32)
    few = [1, 31, 32, 77, 299]
    for token in few:
        bitmask[0, token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))
    bitmask[1, 250 // 32] = 1 << (250 % 32)  # one token: forced
    bitmask[2] = -1  # everything
    rows = np.array([0, 1, 3])
    hidden = torch.randn(4, model.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    worker = SimpleNamespace(model=model, tp=TPInfo(), device=torch.device("cpu"), masks=DeviceMasks("cpu", 8, words))
    logits = Worker._logits(worker, hidden, (rows, bitmask))  # type: ignore[arg-type]
    expected = model.compute_logits(hidden)
    assert logits is not None and expected is not None
    apply_bitmask(expected, rows, bitmask)
    assert torch.equal(logits[[0, 2, 3]], expected[[0, 2, 3]])  # few tokens, unguided, all allowed
    assert torch.isfinite(logits[0]).sum() == len(few)
    assert logits[1].argmax() == 250 and torch.isfinite(logits[1]).sum() == 1  # forced: no head at all


def test_the_tensor_index_is_the_readers_and_follows_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF file's tensor places are read by gguf's reader once, then from the cache directory;
    a rewritten file is read again."""
    monkeypatch.setenv("GUIDESPEC_CACHE_DIR", str(tmp_path / "cache"))
    path = gguf_model(tmp_path, {"*": "Q4_K"}).parent / "tiny.gguf"

    def views(infos: list[Any]) -> dict[str, np.ndarray]:
        file = np.memmap(path, dtype=np.uint8, mode="r")
        return {t.name: t.data(file) for t in infos}

    def readers() -> dict[str, np.ndarray]:
        return {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}

    expected = readers()
    arch, first = checkpoint._tensor_index(path)
    assert arch == "llama" and len(list((tmp_path / "cache" / "gguf-index").glob("*.json"))) == 1

    def no_reader(*args: Any) -> None:
        raise AssertionError("the index was parsed again rather than read back")

    with monkeypatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", no_reader)
        arch_again, read_back = checkpoint._tensor_index(path)
    assert arch_again == "llama"
    for found in (views(first), views(read_back)):
        assert found.keys() == expected.keys()
        assert all(found[n].dtype == expected[n].dtype and np.array_equal(found[n], expected[n]) for n in expected)
    gguf_model(tmp_path, {"*": "Q8_0"})  # the same names, another format: the index must follow
    _, again = checkpoint._tensor_index(path)
    assert {t.type_name for t in again if len(t.shape) == 2} == {"Q8_0"}
    assert all(np.array_equal(v, readers()[n]) for n, v in views(again).items())
