"""The sampler: greedy, temperature, top-k, top-p, per-request seeds; bitmask application."""

from __future__ import annotations

import numpy as np
import torch

from guidespec.worker.mask import apply_bitmask, only_allowed
from guidespec.worker.sampler import ACCEPT, DRAW, counter_uniforms, inverse_cdf, sample


def _params(rows: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = -1):  # type: ignore[no-untyped-def]
    return (
        torch.full((rows,), temperature),
        torch.full((rows,), top_k),
        torch.full((rows,), top_p),
        torch.full((rows,), seed),
        torch.arange(rows),
    )


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 100)
    assert torch.equal(sample(logits, *_params(5, temperature=0.0)), logits.argmax(-1))


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(6, 50)
    assert torch.equal(sample(logits.clone(), *_params(6, top_k=1)), logits.argmax(-1))
    assert torch.equal(sample(logits.clone(), *_params(6, top_p=1e-6)), logits.argmax(-1))


def test_top_k_only_draws_from_the_k_best() -> None:
    logits = torch.randn(1, 30).repeat(400, 1)
    tokens = sample(logits, *_params(400, top_k=3), generator=torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) <= set(logits[0].topk(3).indices.tolist())
    assert len(set(tokens.tolist())) == 3


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(2000, 1)
    tokens = sample(logits, *_params(2000, top_p=0.75), generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=4).float() / 2000
    assert counts[2] == 0 and counts[3] == 0  # 0.5 + 0.3 >= 0.75: two tokens kept
    assert abs(counts[0] - 0.5 / 0.8) < 0.05


def test_temperature_sampling_follows_the_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]]).repeat(20000, 1)
    tokens = sample(logits, *_params(20000, temperature=0.5), generator=torch.Generator().manual_seed(1))
    freq = torch.bincount(tokens, minlength=3).float() / 20000
    torch.testing.assert_close(freq, (logits[0] / 0.5).softmax(-1), atol=0.015, rtol=0)


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(4, 1000)
    alone = sample(
        logits[2:3].clone(),
        torch.tensor([1.0]),
        torch.tensor([0]),
        torch.tensor([1.0]),
        torch.tensor([42]),
        torch.tensor([7]),
    )
    temperature, top_k, top_p, _, _ = _params(4)
    batched = sample(
        logits.clone(), temperature, top_k, top_p, torch.tensor([-1, 5, 42, -1]), torch.tensor([0, 0, 7, 0])
    )
    assert batched[2] == alone[0]


def test_bitmask_masks_only_the_named_rows() -> None:
    logits = torch.zeros(3, 40)
    bitmask = np.zeros((1, 2), dtype=np.int32)
    bitmask[0, 0] = 1 << 3  # token 3
    bitmask[0, 1] = 1 << 1  # token 33
    apply_bitmask(logits, np.array([1]), bitmask)
    assert torch.isinf(logits[1]).sum() == 38 and logits[1, 3] == 0 and logits[1, 33] == 0
    assert not torch.isinf(logits[0]).any() and not torch.isinf(logits[2]).any()


def test_rows_whose_mask_allows_one_token_are_found() -> None:
    """The workers skip the LM head for these rows: the token must be exactly the one allowed."""
    vocab = 70  # three words, the last one partly past the vocabulary
    bitmask = np.zeros((5, 3), dtype=np.int32)
    bitmask[0, 1] = 1 << 5  # token 37 alone
    bitmask[1, 0] = 0b11  # tokens 0 and 1
    bitmask[2, 2] = np.array(1 << 31, dtype=np.uint32).view(np.int32)  # token 95: past the vocabulary
    bitmask[3, 0] = 1  # token 0 alone
    bitmask[4, 2] = 1 << 5  # token 69 alone, the last one
    rows = np.array([0, 2, 3, 4, 6], dtype=np.int32)  # logits rows 1 and 5 are unguided
    found = only_allowed(rows, bitmask, 7, vocab)
    assert found.tolist() == [37, -1, -1, -1, 0, -1, 69]
    logits = torch.randn(7, vocab)
    apply_bitmask(logits, rows, bitmask)
    for row, token in enumerate(found.tolist()):  # where one token is allowed, the masked argmax is it
        if token >= 0:
            assert logits[row].argmax().item() == token and torch.isinf(logits[row]).sum() == vocab - 1


def test_counter_uniforms_are_uniform_and_a_function_of_seed_index_and_stream() -> None:
    """Over indices of one seed, and over seeds at one index: in [0, 1), evenly spread (a
    chi-square over 50 bins), uncorrelated with the next index; the same arguments give the same
    numbers, another stream other ones."""
    n = 100_000
    along = counter_uniforms(np.full(n, 42), np.arange(n), DRAW)
    across = counter_uniforms(np.arange(n) * 3 + 2**40, np.full(n, 9), DRAW)
    for u in (along, across):
        assert u.dtype == np.float32 and 0 <= u.min() and u.max() < 1
        counts = np.histogram(u, bins=50, range=(0, 1))[0]
        statistic = float(((counts - n / 50) ** 2 / (n / 50)).sum())
        assert statistic < 90, statistic  # (49 degrees of freedom: P(> 90) < 0.001)
        assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.02
    assert np.array_equal(counter_uniforms(np.full(n, 42), np.arange(n), DRAW), along)
    assert np.mean(counter_uniforms(np.full(n, 42), np.arange(n), ACCEPT) == along) < 1e-3


def test_seeded_draws_follow_the_softmax_across_seeds() -> None:
    """Rows of one distribution, each its own seed: the draws' frequencies are the softmax (the
    counter-based numbers through inverse_cdf)."""
    rows = 20000
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0, 2.0]]).repeat(rows, 1)
    tokens = sample(
        logits,
        torch.full((rows,), 0.7),
        torch.zeros(rows, dtype=torch.long),
        torch.ones(rows),
        torch.arange(rows) * 13 + 5,
        torch.full((rows,), 3),
    )
    freq = torch.bincount(tokens, minlength=5).float() / rows
    torch.testing.assert_close(freq, (logits[0] / 0.7).softmax(-1), atol=0.015, rtol=0)


def test_inverse_cdf_picks_the_token_whose_cumulative_weight_passes_u() -> None:
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0]]).repeat(5, 1)  # (not normalised)
    uniforms = torch.tensor([0.0, 0.49, 0.5, 0.74, 0.9999])
    assert inverse_cdf(weights, uniforms).tolist() == [1, 1, 3, 3, 4]
