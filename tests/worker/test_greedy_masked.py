"""The worker's greedy pick of masked rows without [rows, vocab] arrays (``worker.greedy_masked``)
and the one-token rows it settles without logits (``kernels.single_tokens``): the same tokens as
the whole path (the LM head of every row, the masks applied, ``verify``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from guidespec.bitmask import allowed_counts, bitmask_width
from guidespec.config import ModelConfig
from guidespec.model_files import load_hf_config
from guidespec.protocol import NO_TOKEN
from guidespec.worker import kernels
from guidespec.worker.mask import DeviceMasks, apply_bitmask, only_allowed
from guidespec.worker.model import LlamaModel
from guidespec.worker.tp import TPInfo
from guidespec.worker.verify import accept_greedy, verify
from guidespec.worker.worker import _logits_and_masks, greedy_masked
from tests.conftest import make_tiny_model
from tests.worker.test_quantized import gguf_model


def _set(bitmask: np.ndarray, row: int, tokens: list[int]) -> None:
    for token in tokens:
        bitmask[row, token // 32] |= np.uint32(1 << (token % 32)).view(np.int32)


def _masks(vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits rows 0..7 of which 6 are guided: a forced row, a few-token row, a dense random row,
    a row allowing nothing, a forced row whose token is the vocabulary's last, and every token."""
    rng = np.random.default_rng(vocab)
    bitmask = np.zeros((6, bitmask_width(vocab)), dtype=np.int32)
    _set(bitmask, 0, [vocab // 3])
    _set(bitmask, 1, [1, 31, 32, 77, vocab - 2])
    bitmask[2] = rng.integers(-(2**31), 2**31, bitmask.shape[1], dtype=np.int64).astype(np.int32)
    _set(bitmask, 4, [vocab - 1])
    bitmask[5] = -1
    return np.array([0, 2, 3, 4, 6, 7]), bitmask


def _whole_path(worker: SimpleNamespace, hidden: torch.Tensor, mask: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The tokens of the path every other step takes: logits of every row, masks applied, verify."""
    logits, unapplied = _logits_and_masks(worker, hidden, mask)  # type: ignore[arg-type]
    assert logits is not None
    if unapplied is not None:
        apply_bitmask(logits, *unapplied)
    rows = hidden.shape[0]
    flat, counts = verify(
        logits,
        np.ones(rows, np.int32),
        [np.zeros(0, np.int32)] * rows,
        np.zeros(rows, np.float32),
        np.zeros(rows, np.int32),
        np.ones(rows, np.float32),
        np.full(rows, -1, np.int64),
        np.zeros(rows, np.int32),
    )
    assert counts.tolist() == [1] * rows
    return flat


def _worker(model: LlamaModel) -> SimpleNamespace:
    words = bitmask_width(model.cfg.vocab_size)
    return SimpleNamespace(model=model, tp=TPInfo(), device=torch.device("cpu"), masks=DeviceMasks("cpu", 8, words))


@pytest.mark.parametrize("kind", ["dense", "gguf"])
def test_greedy_masked_picks_what_the_whole_path_picks(tmp_path: Path, kind: str) -> None:
    """Forced rows (their one token, no logits), few-token rows (their tokens' logits alone, on
    a GGUF head), dense and all-allowed rows (the LM head, the mask read by the pick), a row that
    allows nothing (NO_TOKEN) and unguided rows: the tokens of the whole path, one for one."""
    if kind == "dense":
        folder = make_tiny_model(tmp_path / "m", "llama", vocab_size=300)
    else:
        folder = gguf_model(tmp_path, {"*": "Q4_1"})
    hf = load_hf_config(folder)
    model = LlamaModel(ModelConfig.from_hf(hf), TPInfo(), torch.float32, 64, quantized=kind == "gguf")
    model.load(folder, hf, show_progress=False)
    assert model.computes_chosen_logits == (kind == "gguf")
    worker = _worker(model)
    vocab = model.cfg.vocab_size
    rows, bitmask = _masks(vocab)
    for seed in range(3):
        hidden = torch.randn(8, model.cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
        picked = greedy_masked(worker, hidden, (rows, bitmask))  # type: ignore[arg-type]
        assert picked is not None
        tokens, counts = picked
        expected = _whole_path(worker, hidden, (rows, bitmask))
        np.testing.assert_array_equal(tokens, expected)
        assert counts.tolist() == [1] * 8
        assert tokens[0] == vocab // 3 and tokens[6] == vocab - 1  # forced
        assert tokens[4] == NO_TOKEN  # its mask allows nothing
        assert tokens[2] in (1, 31, 32, 77, vocab - 2)


@pytest.mark.parametrize("layout", [(3, 1, 4), (1, 4, 3), (8,), (3, 0, 1, 4)])
def test_greedy_rows_with_drafts_accept_what_verify_accepts(tmp_path: Path, layout: tuple[int, ...]) -> None:
    """Greedy rows with drafts (jump-forward's forced tokens, n-gram drafts): the picks of
    ``greedy_masked`` and ``accept_greedy`` give ``verify``'s tokens over the whole path's masked
    logits: drafts that all match (then the bonus pick), a draft that differs (then the pick
    there), a row whose mask allows nothing (NO_TOKEN where it is reached), a row without logits
    (a prompt's chunk before its last: no token; it broke an engine once)."""
    folder = gguf_model(tmp_path, {"*": "Q4_1"})
    hf = load_hf_config(folder)
    model = LlamaModel(ModelConfig.from_hf(hf), TPInfo(), torch.float32, 64, quantized=True)
    model.load(folder, hf, show_progress=False)
    worker = _worker(model)
    rows, bitmask = _masks(model.cfg.vocab_size)
    num_logits = np.array(layout, dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(num_logits)[:-1]])
    for seed in range(2):
        hidden = torch.randn(8, model.cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
        picks = _whole_path(worker, hidden, (rows, bitmask))  # each logits row's own greedy pick
        for miss in (None, 1):  # every draft the pick / the second draft of each row not
            drafts = []
            for start, n in zip(starts.tolist(), layout):
                draft = [max(int(t), 0) for t in picks[start : start + n - 1]]  # (a draft is a token)
                if miss is not None and miss < len(draft):
                    draft[miss] = (draft[miss] + 1) % model.cfg.vocab_size
                drafts.append(np.array(draft, dtype=np.int32))
            logits, unapplied = _logits_and_masks(worker, hidden, (rows, bitmask))  # type: ignore[arg-type]
            assert logits is not None and unapplied is not None
            apply_bitmask(logits, *unapplied)
            b = len(layout)
            expected = verify(
                logits,
                num_logits,
                drafts,
                np.zeros(b, np.float32),
                np.zeros(b, np.int32),
                np.ones(b, np.float32),
                np.full(b, -1, np.int64),
                np.zeros(b, np.int32),
            )
            picked = greedy_masked(worker, hidden, (rows, bitmask))  # type: ignore[arg-type]
            assert picked is not None
            tokens, counts = accept_greedy(picked[0], num_logits, drafts)
            np.testing.assert_array_equal(counts, expected[1], err_msg=f"{layout}, miss {miss}")
            np.testing.assert_array_equal(tokens, expected[0], err_msg=f"{layout}, miss {miss}")
            if layout in ((3, 1, 4), (3, 0, 1, 4)):  # its last row's first position allows nothing: no draft
                assert counts[-1] == 1 and tokens[-1] == NO_TOKEN, (counts, tokens)  # is accepted there


def test_greedy_masked_without_a_forced_or_few_row_reads_every_mask_in_place(tmp_path: Path) -> None:
    """No row settled by its mask: the LM head of every row, each mask read by the pick."""
    folder = make_tiny_model(tmp_path / "m", "llama", vocab_size=300)
    hf = load_hf_config(folder)
    model = LlamaModel(ModelConfig.from_hf(hf), TPInfo(), torch.float32, 64)
    model.load(folder, hf, show_progress=False)
    worker = _worker(model)
    rng = np.random.default_rng(1)
    rows = np.array([1, 2])
    bitmask = rng.integers(-(2**31), 2**31, (2, bitmask_width(300)), dtype=np.int64).astype(np.int32)
    hidden = torch.randn(3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    picked = greedy_masked(worker, hidden, (rows, bitmask))  # type: ignore[arg-type]
    assert picked is not None
    np.testing.assert_array_equal(picked[0], _whole_path(worker, hidden, (rows, bitmask)))


@pytest.mark.parametrize("vocab", [1, 31, 33, 300, 262144])
def test_single_tokens_equals_counting_every_bit(vocab: int) -> None:
    """The kernel, read to each row's second allowed token, finds the rows ``allowed_counts``
    finds: one token allowed (below the vocabulary), none, two, many, a lone bit past the
    vocabulary's end (-1: no token), a row whose second bit is far from its first."""
    width = bitmask_width(vocab)
    rng = np.random.default_rng(vocab)
    bitmask = np.zeros((7, width), dtype=np.int32)
    _set(bitmask, 0, [vocab - 1])
    _set(bitmask, 2, [0, vocab - 1] if vocab > 1 else [0])
    bitmask[3] = rng.integers(-(2**31), 2**31, width, dtype=np.int64).astype(np.int32)
    if 32 * width > vocab:
        _set(bitmask, 4, [32 * width - 1])  # past the vocabulary only
    _set(bitmask, 5, [0])
    bitmask[6] = -1
    found = kernels.single_tokens(bitmask, vocab)
    if found is None:
        pytest.skip("the CPU kernels are not built here (no C compiler)")
    rows = np.arange(7)
    expected = only_allowed(rows, bitmask, 7, vocab, allowed_counts(bitmask))
    np.testing.assert_array_equal(found, expected)
    np.testing.assert_array_equal(only_allowed(rows, bitmask, 7, vocab), expected)
    assert found[0] == vocab - 1 and found[5] == 0 and found[1] == -1 and found[4] == -1
