"""The packed CPU linear kernel against torch: every row count the engine uses (decode, draft
verification, prefill), output sizes that are not a multiple of the block, biases; a row's
result must not depend on the other rows of the batch."""

from __future__ import annotations

import ast
from concurrent.futures import ThreadPoolExecutor
import platform
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F

from guidespec.worker import kernels
from tests.worker.builds import build_for

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the kernel is not built")


def _case(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random weight [n, k], input [m, k] and bias [n], seeded by the shape."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    return torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize("n,k", [(960, 576), (49152 // 8, 64), (37, 100), (16, 1), (5, 33)])
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 6, 7, 13, 70])
def test_packed_linear_matches_torch(m: int, n: int, k: int) -> None:
    w, x, bias = _case(m, n, k)
    packed = kernels.pack(w)
    assert isinstance(packed, kernels.PackedWeight) and packed.shape == w.shape
    torch.testing.assert_close(kernels.linear(x, packed), F.linear(x, w), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(kernels.linear(x, packed, bias), F.linear(x, w, bias), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("n,k", [(960, 576), (37, 100), (16, 1), (5, 33)])
@pytest.mark.parametrize("m", [0, 1, 3, 6, 7, 13])
def test_int8_linear_matches_its_dequantized_weight_and_stays_near_the_original(m: int, n: int, k: int) -> None:
    w, x, bias = _case(m, n, k)
    quantized = kernels.quantize(w)
    assert isinstance(quantized, kernels.QuantizedWeight) and quantized.blocks.dtype == torch.int8
    rounded = kernels.dense(quantized)
    assert float((rounded - w).abs().max()) <= float(w.abs().max()) / 254 + 1e-6  # half a step of the row's scale
    torch.testing.assert_close(kernels.linear(x, quantized, bias), F.linear(x, rounded, bias), atol=1e-4, rtol=1e-5)
    if m:
        error = (kernels.linear(x, quantized) - F.linear(x, w)).norm() / F.linear(x, w).norm()
        assert float(error) < 0.01
    ids = torch.tensor([0, n - 1, min(16, n - 1)])
    torch.testing.assert_close(kernels.embedding(ids, quantized), rounded[ids])


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(0)
    w = kernels.pack(torch.randn(300, 576, generator=g))
    x = torch.randn(23, 576, generator=g)
    alone = torch.cat([kernels.linear(x[i : i + 1], w) for i in range(len(x))])
    for m in (2, 4, 6, 7, 23):
        assert torch.equal(torch.cat([kernels.linear(x[i : i + m], w) for i in range(0, len(x), m)]), alone)


def test_packed_embedding_and_unpack_give_the_weight_back() -> None:
    w = torch.randn(1000, 24)
    packed = kernels.pack(w)
    assert torch.equal(kernels.dense(packed), w)
    ids = torch.tensor([0, 15, 16, 999, 17, 17])
    assert torch.equal(kernels.embedding(ids, packed), F.embedding(ids, w))
    assert torch.equal(kernels.embedding(ids.int(), packed), F.embedding(ids, w))  # (torch's indexing)
    assert kernels.embedding(ids[:0], packed).shape == (0, 24)
    for bad in (1000, -1):
        with pytest.raises(IndexError):
            kernels.embedding(torch.tensor([3, bad]), packed)


def test_weights_the_kernel_cannot_take_stay_as_they_are() -> None:
    w16 = torch.randn(32, 8, dtype=torch.bfloat16)
    assert kernels.pack(w16) is w16
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(kernels.linear(x, w16), F.linear(x, w16))


def _reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: list[int],
    starts: list[int],
    n: int,
    g: int,
    window: int | None = None,
) -> torch.Tensor:
    out = torch.empty_like(q)
    hkv, d = k.shape[1], k.shape[3]
    for r, (slot, start) in enumerate(zip(slots, starts)):
        for j in range(n):
            first = 0 if window is None else max(0, start + j + 1 - window)
            keys, values = k[slot, :, first : start + j + 1], v[slot, :, first : start + j + 1]  # [hkv, L, D]
            qj = q[r * n + j].view(hkv, g, d)
            p = torch.softmax(qj @ keys.transpose(-1, -2) * d**-0.5, dim=-1)
            out[r * n + j] = (p @ values).reshape(hkv * g, d)
    return out


@pytest.mark.parametrize("n", [1, 2, 4, 9])
@pytest.mark.parametrize("g,d", [(3, 64), (1, 16), (2, 16), (6, 32), (2, 128)])
def test_cache_attention_matches_torch(n: int, g: int, d: int) -> None:
    gen = torch.Generator().manual_seed(n * 100 + g + d)
    hkv, max_len = 2, 300
    k = torch.randn(5, hkv, max_len, d, generator=gen)
    v = torch.randn(5, hkv, max_len, d, generator=gen)
    # a first token, a short and a long context, and one that ends where the cache does (its last keys
    # are not a whole vector of 8: 300 = 37 * 8 + 4)
    slots, starts = [3, 0, 4, 1], [0, 17, 250, max_len - n]
    q = torch.randn(len(slots) * n, hkv * g, d, generator=gen) * 3
    tables = torch.tensor(slots, dtype=torch.int32)[:, None]  # the cache by slot: one block a row
    out = kernels.cache_attention(q, _heads(k), _heads(v), tables, torch.tensor(starts, dtype=torch.int32), n, g)
    assert out is not None
    torch.testing.assert_close(out, _reference_attention(q, k, v, slots, starts, n, g), atol=1e-5, rtol=1e-5)


def _heads(cache: torch.Tensor) -> torch.Tensor:
    """A cache by slot [S, hkv, L, D] in the kernels' layout, a head's blocks together: [hkv, S, L, D]
    (one block of L positions a slot)."""
    return cache.transpose(0, 1).contiguous()


def _paged(cache: torch.Tensor, block_size: int, order: torch.Tensor) -> torch.Tensor:
    """A cache by slot [S, hkv, L, D] cut into blocks of ``block_size`` positions, block i of slot
    s stored at ``order[s * (L // block_size) + i]``: [hkv, num_blocks, block_size, D]."""
    s, hkv, length, d = cache.shape
    blocks = cache.view(s, hkv, length // block_size, block_size, d).permute(1, 0, 2, 3, 4)
    blocks = blocks.reshape(hkv, -1, block_size, d)
    paged = torch.empty_like(blocks)
    paged[:, order] = blocks
    return paged


@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_cache_attention_reads_blocks_anywhere_through_block_tables(block_size: int) -> None:
    """A paged cache (each row's blocks scattered through the pool, in no order) gives each row the
    attention its contiguous cache gives."""
    gen = torch.Generator().manual_seed(block_size)
    hkv, d, g, n, length = 3, 64, 3, 4, 256
    k, v = torch.randn(4, hkv, length, d, generator=gen), torch.randn(4, hkv, length, d, generator=gen)
    per_row = length // block_size
    order = torch.randperm(4 * per_row, generator=gen)
    tables = order.view(4, per_row).to(torch.int32)
    slots, starts = [2, 0, 3, 1], [0, 13, 100, length - n]
    q = torch.randn(len(slots) * n, hkv * g, d, generator=gen)
    paged = kernels.cache_attention(
        q,
        _paged(k, block_size, order),
        _paged(v, block_size, order),
        tables[slots].contiguous(),
        torch.tensor(starts, dtype=torch.int32),
        n,
        g,
    )
    by_slot = kernels.cache_attention(
        q,
        _heads(k),
        _heads(v),
        torch.tensor(slots, dtype=torch.int32)[:, None],
        torch.tensor(starts, dtype=torch.int32),
        n,
        g,
    )
    assert paged is not None and by_slot is not None
    assert torch.equal(paged, by_slot)  # the same keys in the same order: the same bits
    torch.testing.assert_close(paged, _reference_attention(q, k, v, slots, starts, n, g), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 8, 13, 64, 1000])
@pytest.mark.parametrize("n", [1, 3, 20])  # decode, a verify, a prefill chunk of two tasks (16 + 4 tokens)
def test_cache_attention_in_a_sliding_window_matches_torch(window: int, n: int) -> None:
    """Each query attends its last ``window`` keys only (the window's first key anywhere in a block
    of 8, or of the cache's blocks), in a paged cache as in the cache by slot."""
    gen = torch.Generator().manual_seed(window * 10 + n)
    hkv, d, g, length, block_size = 2, 32, 3, 160, 16
    k, v = torch.randn(4, hkv, length, d, generator=gen), torch.randn(4, hkv, length, d, generator=gen)
    per_row = length // block_size
    order = torch.randperm(4 * per_row, generator=gen)
    slots, starts = [2, 0, 3, 1], [0, 4, 61, length - n]
    q = torch.randn(len(slots) * n, hkv * g, d, generator=gen) * 3
    int32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    paged = kernels.cache_attention(
        q,
        _paged(k, block_size, order),
        _paged(v, block_size, order),
        order.view(4, per_row).to(torch.int32)[slots].contiguous(),
        int32(starts),
        n,
        g,
        window,
    )
    by_slot = kernels.cache_attention(q, _heads(k), _heads(v), int32(slots)[:, None], int32(starts), n, g, window)
    assert paged is not None and by_slot is not None and torch.equal(paged, by_slot)
    expected = _reference_attention(q, k, v, slots, starts, n, g, window)
    torch.testing.assert_close(paged, expected, atol=1e-5, rtol=1e-5)


def test_cache_attention_of_a_token_does_not_depend_on_later_tokens_or_other_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 4, 64, 64, generator=gen), torch.randn(3, 4, 64, 64, generator=gen)  # [hkv, slots, L, D]
    q = torch.randn(4 * 5, 9, 64, generator=gen)
    int32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    together = kernels.cache_attention(q, k, v, int32([[0], [1], [2], [3]]), int32([10, 20, 30, 40]), 5, 3)
    assert together is not None
    for r in range(4):
        for j in range(5):  # token j alone, as a decode step would run it
            alone = kernels.cache_attention(
                q[r * 5 + j : r * 5 + j + 1], k, v, int32([[r]]), int32([10 * (r + 1) + j]), 1, 3
            )
            assert alone is not None and torch.equal(alone[0], together[r * 5 + j])


@pytest.mark.parametrize("t", [1, 3, 40])  # decode, a verify, a prefill chunk (threads from 32 rows)
def test_layer_ops_match_torch(t: int) -> None:
    """add_rms_norm, rope_into_cache and silu_mul (layer_ops.c) against the torch ops the model runs
    without them; each row alone gives the same bits as in its batch."""
    from guidespec.worker.model import _rms_norm, rotary_tables
    from guidespec.worker.rotary import apply_rope as _rope
    from transformers import LlamaConfig

    gen = torch.Generator().manual_seed(t)
    x, delta, w = torch.randn(t, 576, generator=gen), torch.randn(t, 576, generator=gen), torch.rand(576, generator=gen)
    fused = kernels.add_rms_norm(x, delta, w, 1e-5)
    assert fused is not None
    torch.testing.assert_close(fused[0], x + delta, atol=0, rtol=0)
    torch.testing.assert_close(fused[1], _rms_norm(x + delta, w, 1e-5), atol=1e-5, rtol=1e-5)
    alone = [kernels.add_rms_norm(x[i : i + 1], delta[i : i + 1], w, 1e-5) for i in range(t)]
    assert torch.equal(torch.cat([a[1] for a in alone if a is not None]), fused[1])
    first = kernels.add_rms_norm(x, None, w, 1e-5)
    assert first is not None and first[0] is x and torch.allclose(first[1], _rms_norm(x, w, 1e-5), atol=1e-5)

    gate_up = torch.randn(t, 2 * 1536, generator=gen) * 4
    act = kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert act is not None
    torch.testing.assert_close(act, F.silu(gate) * up, atol=1e-5, rtol=1e-5)

    hq, hkv, d, max_len = 9, 3, 64, 128
    cos, sin = rotary_tables(LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, rope_theta=1e5), max_len)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    start = int(torch.randint(0, max_len, (1,), generator=gen))
    positions = (start + torch.arange(t)) % max_len  # distinct cache cells
    slots = torch.randint(0, 4, (t,), generator=gen)
    k_cache, v_cache = torch.zeros(hkv, 4, max_len, d), torch.zeros(hkv, 4, max_len, d)  # a head's slots together
    rows = slots * max_len + positions  # the cache by slot: blocks of max_len positions
    q = kernels.rope_into_cache(qkv, hq, hkv, cos, sin, positions, rows, k_cache, v_cache)
    qk = _rope(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos[positions], sin[positions])
    assert q is not None
    torch.testing.assert_close(q, qk[:, :hq], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache[:, slots, positions].transpose(0, 1), qk[:, hq:], atol=1e-5, rtol=1e-5)
    assert torch.equal(v_cache[:, slots, positions].transpose(0, 1), qkv[:, (hq + hkv) * d :].view(t, hkv, d))
    # the same tokens into a paged cache (blocks of 16, scattered): each at its block and offset
    pool_k, pool_v = torch.zeros(hkv, 4 * max_len // 16, 16, d), torch.zeros(hkv, 4 * max_len // 16, 16, d)
    order = torch.randperm(pool_k.shape[1], generator=gen)
    block = order[rows // 16]
    again = kernels.rope_into_cache(qkv, hq, hkv, cos, sin, positions, block * 16 + rows % 16, pool_k, pool_v)
    assert again is not None and torch.equal(again, q)
    assert torch.equal(pool_k[:, block, rows % 16], k_cache[:, slots, positions])
    assert torch.equal(pool_v[:, block, rows % 16], v_cache[:, slots, positions])


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


ARCHS = ("-march=x86-64", "-march=x86-64-v3", "-march=x86-64-v4")


@pytest.fixture(scope="module")
def arch_builds() -> dict[str, Path | None]:
    """Each vector width's build, built side by side (tests/worker/builds.py)."""
    with ThreadPoolExecutor(len(ARCHS)) as pool:
        return dict(zip(ARCHS, pool.map(build_for, ARCHS)))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 instruction sets")
@pytest.mark.parametrize(
    "arch,runs",
    [
        ("-march=x86-64", True),  # SSE2 only: 4-wide vectors
        ("-march=x86-64-v3", _cpu_has("avx2")),  # AVX2: 8-wide
        ("-march=x86-64-v4", _cpu_has("avx512f")),  # AVX-512, 16-wide: built everywhere, run where the CPU has it
    ],
)
def test_each_vector_width_builds_and_matches_torch(
    monkeypatch: pytest.MonkeyPatch, arch_builds: dict[str, Path | None], arch: str, runs: bool
) -> None:
    """The kernels at each vector width vec.h picks, not only this machine's: built, and where
    the CPU can run them, checked against torch (linear, int8, attention) and for rows that do
    not depend on their batch; a few rows' picks from an int8 copy equal the exact picks."""
    path = arch_builds[arch]
    assert path is not None and path.exists()
    if not runs:
        pytest.skip(f"built with {arch}; this CPU lacks the instruction set to run it")
    monkeypatch.setattr(kernels.loader, "library", lambda: kernels.load(path))
    for m, n, k in [(1, 960, 576), (7, 37, 100), (13, 16, 1)]:
        w, x, bias = _case(m, n, k)
        torch.testing.assert_close(kernels.linear(x, kernels.pack(w), bias), F.linear(x, w, bias), atol=1e-4, rtol=1e-5)
        quantized = kernels.quantize(w)
        torch.testing.assert_close(
            kernels.linear(x, quantized), F.linear(x, kernels.dense(quantized)), atol=1e-4, rtol=1e-5
        )
    w = kernels.pack(_case(0, 300, 576)[0])
    x = _case(23, 1, 576)[1]
    alone = torch.cat([kernels.linear(x[i : i + 1], w) for i in range(len(x))])
    assert torch.equal(kernels.linear(x, w), alone)
    mask = _sparse_masks(23, 300, 0)  # (the picks' tiles are 2 vectors wide: what a mask word covers differs)
    got, want = kernels.linear_argmax(x, w, 300, mask), _picks_of_logits(x, w, 300, mask)  # type: ignore[arg-type]
    assert got is not None and (got[0] == want[0]).all() and (got[1] == want[1]).all()  # type: ignore[index,union-attr]
    test_picks_from_the_int8_copy_are_the_exact_picks(monkeypatch, 2, 300, 4)
    test_cache_attention_matches_torch(4, 3, 64)
    test_cache_attention_of_a_token_does_not_depend_on_later_tokens_or_other_rows()


def test_no_worker_test_passes_by_returning_early() -> None:
    """A case this machine cannot run (an instruction set the CPU lacks) is skipped, with the
    reason, not returned from: a test that returns early counts as passed."""
    early = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for test in ast.parse(path.read_text()).body:
            if isinstance(test, ast.FunctionDef) and test.name.startswith("test_"):
                early += [
                    f"{path.name}:{node.lineno} ({test.name})"
                    for node in _own_nodes(test)
                    if isinstance(node, ast.Return)
                ]
    assert not early, f"tests returning early (pytest.skip instead): {early}"


def _own_nodes(function: ast.FunctionDef) -> Iterator[ast.AST]:
    """The nodes of ``function``'s body, not those of functions or lambdas defined in it."""
    stack: list[ast.AST] = list(function.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def test_the_c_decoder_stack_equals_the_python_loop(real_model_dir) -> None:  # type: ignore[no-untyped-def]
    """LlamaModel.forward's one C call (decoder.c) gives the Python loop's hidden states bit for
    bit (the same kernels in the same order), GGUF blocks and fp32 weights, decode and verify."""
    import numpy as np

    from guidespec.config import ModelConfig
    from guidespec.model_files import load_hf_config
    from guidespec.worker.model import ForwardBatch, LlamaModel
    from guidespec.worker.tp import TPInfo

    hf = load_hf_config(real_model_dir)
    for quantized in (True, False):
        model = LlamaModel(ModelConfig.from_hf(hf), TPInfo(), torch.float32, 256, quantized=quantized)
        model.load(real_model_dir, hf, show_progress=False)
        kv = model.create_kv_cache(2)
        model.forward(ForwardBatch.create(np.arange(60) % 700, [0, 1], [0, 0], [30, 30], [1, 1]), kv)
        for n in (1, 4):
            batch = ForwardBatch.create(np.arange(2 * n) + 5, [0, 1], [30, 30], [n, n], [n, n])
            in_c = model.forward(batch, kv)
            assert model._stack is not None  # the C path ran
            python = model.forward(batch, kv, capture=(0,))  # capturing runs the Python loop
            assert torch.equal(in_c, python)


@pytest.mark.parametrize("vocab,num_rows,rows", [(49152, 3, [2, 0]), (1000, 5, [4, 1, 3]), (33, 2, [1]), (64, 1, [])])
def test_the_bitmask_kernel_forbids_exactly_what_numpy_unpacks(vocab: int, num_rows: int, rows: list[int]) -> None:
    import numpy as np

    rng = np.random.default_rng(vocab + num_rows)
    words = -(-vocab // 32)
    logits = torch.from_numpy(rng.normal(size=(num_rows, vocab)).astype(np.float32))
    bitmask = rng.integers(-(2**31), 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
    if len(rows):
        bitmask[0, : words // 2] = -1  # whole words allowed, and whole words forbidden
        bitmask[-1, words // 2 :] = 0
    bits = (bitmask.view(np.uint32)[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    allowed = bits.reshape(len(rows), words * 32)[:, :vocab].astype(bool)
    expected = logits.numpy().copy()
    for i, r in enumerate(rows):
        expected[r][~allowed[i]] = -np.inf
    assert kernels.apply_bitmask(logits, np.array(rows, dtype=np.int64), bitmask)
    np.testing.assert_array_equal(logits.numpy(), expected)


def test_argmax_rows_picks_as_torch_does_and_finds_rows_that_allow_nothing() -> None:
    import numpy as np

    logits = torch.randn(12, 1001, generator=torch.Generator().manual_seed(3))
    logits[1, [7, 500]] = 50.0  # a tie: the first one
    logits[2] = float("-inf")  # nothing allowed
    logits[3] = float("-inf")
    logits[3, 1000] = -1e30  # one token left, the last one
    logits[4, 9] = float("nan")  # torch.argmax takes a NaN as the largest
    logits[5, [0, 1]] = float("inf")
    best, dead = kernels.argmax_rows(logits)  # type: ignore[misc]
    np.testing.assert_array_equal(best, logits.argmax(dim=-1).numpy())
    np.testing.assert_array_equal(dead, torch.isneginf(logits).all(dim=-1).numpy())
    assert dead.tolist() == [False, False, True] + [False] * 9


@settings(max_examples=200, deadline=None)
@given(
    vocab=st.integers(1, 100),
    seed=st.integers(0, 2**31 - 1),
    values=st.lists(st.sampled_from([0.0, -0.0, 1.0, 2.0, float("inf"), float("-inf"), float("nan")]), max_size=6),
)
def test_argmax_rows_in_vectors_picks_as_torch_does(vocab: int, seed: int, values: list[float]) -> None:
    """The pick of a row, read in vectors: the first of ties (-0.0 equal to 0.0), the first NaN, a
    row of -inf, rows shorter and longer than a vector, random values placed anywhere; and through
    masks of three densities."""
    import numpy as np

    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.choice([-1.0, 0.0, 1.0, 3.0], (4, vocab)).astype(np.float32))
    logits[1] = float("-inf")
    for i, value in enumerate(values):
        logits[i % 4, int(rng.integers(vocab))] = value
    best, dead = kernels.argmax_rows(logits)  # type: ignore[misc]
    np.testing.assert_array_equal(best, logits.argmax(dim=-1).numpy())
    np.testing.assert_array_equal(dead, torch.isneginf(logits).all(dim=-1).numpy())
    # read through masks, dense (in vectors) and sparse (token by token): as if applied first
    width = (vocab + 31) // 32
    for density in (0.02, 0.5, 0.97):
        bits = rng.random((4, width * 32)) < density
        bitmask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
        rows = np.arange(4)
        best, dead = kernels.argmax_rows(logits, (rows, bitmask))  # type: ignore[misc]
        masked = logits.clone()
        assert kernels.apply_bitmask(masked, rows, bitmask)
        np.testing.assert_array_equal(dead, torch.isneginf(masked).all(dim=-1).numpy())
        np.testing.assert_array_equal(best[~dead], masked.argmax(dim=-1).numpy()[~dead])


def test_argmax_rows_reading_a_bitmask_picks_as_if_it_were_applied() -> None:
    """A greedy row's mask read by its pick (not applied first) gives the pick of the masked row:
    ties, NaN, a mask allowing nothing, tokens past the vocabulary in the last word."""
    import numpy as np

    rng = np.random.default_rng(5)
    for vocab in (1, 31, 33, 1000):
        width = (vocab + 31) // 32
        logits = torch.from_numpy(rng.standard_normal((9, vocab)).astype(np.float32))
        logits[0, :] = 1.0  # ties everywhere: the first allowed
        logits[1, vocab // 2] = float("nan")
        rows = np.array([0, 1, 2, 4, 8])
        bitmask = rng.integers(-(2**31), 2**31, (len(rows), width), dtype=np.int64).astype(np.int32)
        bitmask[2] = 0  # allows nothing
        bitmask[3, -1] = -1  # (bits past the vocabulary set)
        best, dead = kernels.argmax_rows(logits, (rows, bitmask))  # type: ignore[misc]
        masked = logits.clone()
        assert kernels.apply_bitmask(masked, rows, bitmask)
        np.testing.assert_array_equal(dead, torch.isneginf(masked).all(dim=-1).numpy())
        np.testing.assert_array_equal(best[~dead], masked.argmax(dim=-1).numpy()[~dead])
        assert (logits[0] == 1.0).all()  # the logits themselves unchanged


def _picks_of_logits(
    x: torch.Tensor, weight: kernels.Weight, vocab: int, mask: tuple[object, object] | None
) -> tuple[object, object]:
    """The reference: the LM head's logits made, then picked (``argmax_rows``, checked against torch above)."""
    picked = kernels.argmax_rows(kernels.linear(x, weight)[:, :vocab].contiguous(), mask)  # type: ignore[arg-type]
    assert picked is not None
    return picked


@settings(max_examples=150, deadline=None)
@given(
    vocab=st.integers(1, 300),
    rows=st.integers(1, 14),
    seed=st.integers(0, 2**31 - 1),
    values=st.lists(st.sampled_from([0.0, -0.0, 2.0, float("inf"), float("-inf"), float("nan")]), max_size=6),
    int8=st.booleans(),
)
def test_linear_argmax_picks_what_the_logits_give(vocab: int, rows: int, seed: int, values: list, int8: bool) -> None:
    """Picks made as the LM head's tiles are summed (no logits written) equal the picks of the
    logits: ties across tiles and in padding lanes past the vocabulary, NaN and infinite values
    (one-hot inputs read a weight's column as the logits), rows a mask allows nothing in, and
    masks of three densities; packed fp32 and int8 weights."""
    import numpy as np

    rng = np.random.default_rng(seed)
    k = 4
    w = torch.from_numpy(rng.choice([-1.0, 0.0, 1.0, 3.0], (vocab + int(rng.integers(0, 20)), k)).astype(np.float32))
    if not int8:  # (an int8 weight holds finite values only)
        for i, value in enumerate(values):
            w[int(rng.integers(vocab)), i % k] = value
    x = torch.from_numpy(rng.choice([0.0, 1.0, -0.5], (rows, k)).astype(np.float32))
    x[0] = torch.eye(k)[int(rng.integers(k))]
    weight = kernels.quantize(w) if int8 else kernels.pack(w)
    masks: list[tuple[object, object] | None] = [None]
    width = (vocab + 31) // 32
    for density in (0.0, 0.05, 0.9):
        bits = rng.random((rows, width * 32)) < density
        chosen = np.flatnonzero(rng.random(rows) < 0.7)
        masks.append((chosen, np.packbits(bits[chosen], axis=1, bitorder="little").view(np.int32)))
    for mask in masks:
        got = kernels.linear_argmax(x, weight, vocab, mask)  # type: ignore[arg-type]
        assert got is not None
        want = _picks_of_logits(x, weight, vocab, mask)
        np.testing.assert_array_equal(got[0], want[0])  # type: ignore[index]
        np.testing.assert_array_equal(got[1], want[1])  # type: ignore[index]


@pytest.mark.parametrize("threads", [1, 2])
def test_linear_argmax_over_threads_picks_the_first_largest(threads: int) -> None:
    """A batch-64 LM head of 49,152 tokens (past the parallel threshold: threads take tiles as
    they come free) picks what its logits give: the first of equal maxima far apart (in tiles of
    different threads), a NaN row, a row its mask allows nothing in, one allowing a single token,
    a vocabulary shorter than the weight's rows."""
    import numpy as np

    g = torch.Generator().manual_seed(11)
    vocab, k = 49152 - 3, 64
    w = torch.randn(49152, k, generator=g)
    w[[40000, 320, 12352]] = w[7] * 3  # equal maxima in one vector lane, in tiles far apart
    x = torch.randn(64, k, generator=g)
    x[5] = w[7]
    x[6, 0] = float("nan")
    bitmask = np.zeros((3, (vocab + 31) // 32), dtype=np.int32)
    bitmask[1, 40000 // 32] = 1 << (40000 % 32)
    bitmask[2] = -1
    mask = (np.array([9, 10, 5]), bitmask)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for weight in (kernels.pack(w), kernels.quantize(w)):
            for m in (None, mask):
                got = kernels.linear_argmax(x, weight, vocab, m)  # type: ignore[arg-type]
                assert got is not None
                want = _picks_of_logits(x, weight, vocab, m)
                np.testing.assert_array_equal(got[0], want[0])  # type: ignore[index]
                np.testing.assert_array_equal(got[1], want[1])  # type: ignore[index]
            assert got[0][5] == 320 and got[0][10] == 40000 and got[1][9] and not got[1][6]
    finally:
        torch.set_num_threads(previous)


def _sparse_masks(num_rows: int, vocab: int, seed: int) -> tuple[object, object]:
    """Masks of a guided batch: rows without a mask, rows allowing a few tokens each (where the
    picks skip the LM head's other tiles), scattered among rows allowing most tokens, and one
    allowing a token of the last tile only; the sparse rows are not consecutive."""
    import numpy as np

    rng = np.random.default_rng(seed)
    width = (vocab + 31) // 32
    rows = np.flatnonzero(rng.random(num_rows) < 0.8)
    bits = rng.random((len(rows), width * 32)) < 0.9  # dense
    sparse = rng.random(len(rows)) < 0.6
    bits[sparse] = False
    for i in np.flatnonzero(sparse):
        bits[i, rng.choice(vocab, int(rng.integers(1, 40)), replace=False)] = True
    bits[int(np.flatnonzero(sparse)[0]), : vocab - 1] = False
    bits[int(np.flatnonzero(sparse)[0]), vocab - 1] = True
    bits[:, vocab:] = False
    return rows, np.packbits(bits, axis=1, bitorder="little").view(np.int32)


@pytest.mark.parametrize("threads", [1, 2])
def test_linear_argmax_skipping_the_tiles_a_mask_forbids_picks_the_same(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """Sparse masked rows get the LM head only in the tiles their mask allows a token in (in
    groups gathered from rows that are not consecutive): at batch 64 of 49,152 tokens (past the
    parallel threshold) beside unmasked and dense rows, the picks are those of the logits."""
    import numpy as np

    g = torch.Generator().manual_seed(5)
    vocab, k = 49152 - 7, 64
    w, x = torch.randn(49152, k, generator=g), torch.randn(64, k, generator=g)
    monkeypatch.setattr(kernels.loader, "_threads", threads)
    for weight in (kernels.pack(w), kernels.quantize(w)):
        for seed in range(3):
            mask = _sparse_masks(64, vocab, seed)
            got = kernels.linear_argmax(x, weight, vocab, mask)  # type: ignore[arg-type]
            assert got is not None
            want = _picks_of_logits(x, weight, vocab, mask)
            np.testing.assert_array_equal(got[0], want[0])  # type: ignore[index]
            np.testing.assert_array_equal(got[1], want[1])  # type: ignore[index]


def _checked_case(seed: int, rows: int, vocab: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight with equal logits far apart (row 0's input picks tokens 3 and vocab // 2),
    logits one ulp apart (row 1's: vocab - 2 above 7 and vocab - 1), a row of outliers (its int8
    copy is coarse), a row of +-3 whose every product with row 2's input of +-1 of the same signs
    is the int8 sums' largest, a row of 20s whose every product with row 3's input of 1s is the
    largest positive one (AVX2's uint8 127 x int8 63: its int16 sums of two groups of k's reach
    4 x 8001 = 32004 but not 32767; that row is row 3's pick), and random inputs past the first four."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab + 5, k, generator=g)
    w[11] *= 8
    w[[3, vocab // 2], 1] = 50.0
    w[[7, vocab - 1], 0] = 40.0
    w[vocab - 2, 0] = torch.nextafter(torch.tensor(40.0), torch.tensor(float("inf")))
    x = torch.randn(rows, k, generator=g)
    x[0] = torch.eye(k)[1] * 2
    if rows > 1:
        x[1] = torch.eye(k)[0]
    signs = torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0)
    w[5] = signs * 3
    if rows > 2:
        x[2] = signs
    w[13] = 20.0
    if rows > 3:
        x[3] = 1.0
    return w, x


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("vocab,k", [(49152 - 9, 64), (300, 4), (1000, 576)])
def test_picks_from_the_int8_copy_are_the_exact_picks(
    monkeypatch: pytest.MonkeyPatch, threads: int, vocab: int, k: int
) -> None:
    """A packed LM head with its int8 copy (``add_picks_check``) picks 1-6 rows' tokens (17 and 64
    where it sums int8 inputs, AVX-512 VNNI's or AVX2's; with AMX in its tiles and in VNNI's sums,
    each in turn) from the copy and sums the
    candidates again in fp32: the same tokens as the exact
    picks, bit for bit, unmasked, under dense masks and beside rows of sparse masks (those picked
    exactly), with equal logits far apart, logits one ulp apart, and a row of outliers; the
    copy's path is the one taken (the C call settles: 0), except where it must
    leave the rows to the exact picks (every row allowing nothing, a NaN input, inputs so small
    that a scale could underflow)."""
    import numpy as np

    monkeypatch.setattr(kernels.loader, "_threads", threads)
    lib = kernels.loader.library()
    assert lib is not None
    summed = bool(lib.packed_checked_offset())  # (int8 sums: every row count, a batch of 64 too)
    amx = bool(lib.packed_checked_amx(-1))  # (with AMX too: its tiles' sums where k is 64s, and VNNI's)
    try:
        for use in (1, 0) if amx else (0,):
            lib.packed_checked_amx(use)
            _check_int8_copy_picks(summed, vocab, k)
    finally:
        lib.packed_checked_amx(int(amx))
    w, x = _checked_case(0, 2, 300, 4)
    checked = kernels.pack(w)
    kernels.add_picks_check(checked)
    nothing = (np.array([0, 1]), np.zeros((2, 10), dtype=np.int32))
    beside = (np.array([1]), np.zeros((1, 10), dtype=np.int32))  # (a dead row beside an unmasked one)
    x_nan, x_tiny = x.clone(), x * 1e-35  # (a scale for int8 inputs that tiny could underflow)
    x_nan[0, 1] = float("nan")
    for case_x, mask, settles in ((x, nothing, 1), (x_nan, None, 1), (x_tiny, None, 1), (x, beside, 0)):
        assert _settles(case_x, checked, 300, mask) == settles
        got = kernels.linear_argmax(case_x, checked, 300, mask)  # type: ignore[arg-type]
        want = kernels.linear_argmax(case_x, kernels.pack(w), 300, mask)  # type: ignore[arg-type]
        assert got is not None and want is not None
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 instruction sets")
@pytest.mark.parametrize(
    "arch,flag,offset",
    [
        ("-march=x86-64", "sse2", 0),  # the portable tiles: the copy widened to fp32, up to 6 rows
        ("-march=x86-64-v3", "avx2", 64),  # AVX2: maddubs' sums of 7-bit inputs, every row count
        ("-march=x86-64-v4", "avx512f", 0),  # AVX-512 without VNNI: widened, in 16-wide tiles
    ],
)
def test_int8_copy_picks_of_each_instruction_set_are_the_exact_picks(
    monkeypatch: pytest.MonkeyPatch, arch: str, flag: str, offset: int
) -> None:
    """The checked picks as each build makes them, whatever this CPU's own build is (an AVX-512
    host runs AVX2's too): the exact picks' tokens, with the copy's path taken."""
    path = build_for(arch)
    assert path is not None and path.exists()
    if flag not in open("/proc/cpuinfo").read().split():
        pytest.skip(f"built with {arch}; this CPU lacks {flag} to run it")
    lib = kernels.load(path)
    monkeypatch.setattr(kernels.loader, "library", lambda: lib)
    assert lib.packed_checked_offset() == offset
    for vocab, k in ((49152 - 9, 64), (1000, 576)):
        _check_int8_copy_picks(bool(offset), vocab, k)


def _check_int8_copy_picks(summed: bool, vocab: int, k: int) -> None:
    import numpy as np

    for seed in range(3):
        for rows in (1, 2, 6, 17, 64) if summed else (1, 2, 6):
            w, x = _checked_case(seed, rows, vocab, k)
            exact, checked = kernels.pack(w), kernels.pack(w)
            kernels.add_picks_check(checked)
            assert isinstance(checked, kernels.PackedWeight) and checked.check is not None
            rng = np.random.default_rng(seed)
            width = (vocab + 31) // 32
            bits = rng.random((rows, width * 32)) < 0.6
            dense = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
            bits[: rows // 2] = False  # the first half sparse (the exact picks' rows), the rest dense
            for i in range(rows // 2):
                bits[i, rng.choice(vocab, 5, replace=False)] = True
            mixed = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
            for mask in (None, (np.arange(rows), dense), (np.arange(rows), mixed)):
                got = kernels.linear_argmax(x, checked, vocab, mask)  # type: ignore[arg-type]
                want = kernels.linear_argmax(x, exact, vocab, mask)  # type: ignore[arg-type]
                assert got is not None and want is not None
                np.testing.assert_array_equal(got[0], want[0])
                np.testing.assert_array_equal(got[1], want[1])
                assert _settles(x, checked, vocab, mask) == 0
                if mask is None:
                    assert got[0][0] == 3 and (rows == 1 or got[0][1] == vocab - 2)
                    assert rows <= 3 or got[0][3] == 13


def _settles(x: torch.Tensor, weight: kernels.PackedWeight, vocab: int, mask: object) -> int:
    """The checked C call's own answer: 0 where it made the picks, 1 where it left them to the exact picks."""
    import numpy as np

    from guidespec.worker.kernels.ops import _masks_of_rows, _pointer, checked_picks

    masks = _masks_of_rows(x.shape[0], vocab, mask)  # type: ignore[arg-type]
    assert masks is not None
    best, dead = np.empty(x.shape[0], dtype=np.int64), np.empty(x.shape[0], dtype=np.bool_)
    rest = (x.shape[0], vocab, x.shape[1], _pointer(masks[0]), _pointer(masks[1]), masks[2])
    out = (best.ctypes.data, dead.ctypes.data, kernels.loader.threads())
    return 0 if checked_picks(x.contiguous(), weight, rest, out) else 1
