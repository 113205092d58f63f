"""Verification of drafts (rank 0): greedy equals plain greedy decoding; rejection sampling keeps
the masked target distribution exactly, for one-hot (scheduler) drafts and model drafts alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from guidespec.protocol import NO_TOKEN
from guidespec.worker.verify import seeded_uniforms, verify, verify_padded

V = 6
MASKED = 4  # a token the grammar forbids at every position


def _rows(n: int, k: int, temperature: float) -> dict[str, np.ndarray]:
    return dict(
        num_logits=np.full(n, k + 1, dtype=np.int32),
        temperature=np.full(n, temperature, dtype=np.float32),
        top_k=np.zeros(n, dtype=np.int32),
        top_p=np.ones(n, dtype=np.float32),
        seeds=np.arange(n, dtype=np.int64),
        sample_index=np.zeros(n, dtype=np.int32),
    )


def _chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """P(X >= statistic) for Pearson's chi-square over the tokens with probability > 0."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    expected = probs[keep] * counts.sum()
    statistic = float(((counts[keep] - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    return float(
        1
        - torch.special.gammainc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )


def _masked_logits(rows: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    logits = torch.randn(1, V).repeat(rows, 1) * 1.5
    logits[:, MASKED] = float("-inf")  # what apply_bitmask leaves for a forbidden token
    return logits


def test_greedy_accepts_while_the_draft_is_the_argmax() -> None:
    logits = torch.tensor([[0.0, 5, 0, 0, 0, 0], [0, 0, 5, 0, 0, 0], [0, 0, 0, 5, 0, 0], [5.0, 0, 0, 0, 0, 0]])
    p = _rows(1, 3, 0.0)
    tokens, counts = verify(
        logits,
        p["num_logits"],
        [np.array([1, 2, 0])],
        p["temperature"],
        p["top_k"],
        p["top_p"],
        p["seeds"],
        p["sample_index"],
    )
    assert counts.tolist() == [3] and tokens.tolist() == [1, 2, 3]  # d1, d2 accepted; d3 != argmax, corrected
    tokens, counts = verify(
        logits,
        p["num_logits"],
        [np.array([1, 2, 3])],
        p["temperature"],
        p["top_k"],
        p["top_p"],
        p["seeds"],
        p["sample_index"],
    )
    assert tokens.tolist() == [1, 2, 3, 0]  # all accepted, plus the bonus token


@pytest.mark.parametrize("draft", [0, 2, MASKED])
def test_rejection_sampling_with_a_one_hot_draft_keeps_the_masked_distribution(draft: int) -> None:
    n = 20000
    logits = _masked_logits(2 * n, seed=draft).view(n, 2, V).reshape(2 * n, V)
    p = _rows(n, 1, 1.0)
    tokens, counts = verify(
        logits,
        p["num_logits"],
        [np.array([draft])] * n,
        p["temperature"],
        p["top_k"],
        p["top_p"],
        p["seeds"],
        p["sample_index"],
    )
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    first = tokens[offsets]
    target = torch.softmax(logits[0], -1).numpy()
    histogram = np.bincount(first, minlength=V)
    assert histogram[MASKED] == 0  # masks fail closed: a forbidden draft is never accepted
    assert _chi_square_p_value(histogram, target) > 1e-3
    accepted = (counts == 2).mean()  # a one-hot draft is accepted with probability p'(draft)
    assert abs(accepted - target[draft]) < 4 * np.sqrt(target[draft] * (1 - target[draft]) / n) + 1e-9


def test_rejection_sampling_with_model_drafts_keeps_the_masked_distribution() -> None:
    n = 20000
    logits = _masked_logits(3 * n, seed=7)
    torch.manual_seed(1)
    q = torch.softmax(torch.randn(2, V) * 2, -1)  # the draft model's (masked) distributions, one per draft step
    q[:, MASKED] = 0
    q /= q.sum(-1, keepdim=True)
    g = torch.Generator().manual_seed(3)
    drafts = [
        torch.stack([torch.multinomial(q[j], 1, generator=g) for j in range(2)]).flatten().numpy() for _ in range(n)
    ]
    p = _rows(n, 2, 1.0)
    tokens, counts = verify(
        logits,
        p["num_logits"],
        drafts,
        p["temperature"],
        p["top_k"],
        p["top_p"],
        p["seeds"],
        p["sample_index"],
        draft_probs=[q] * n,
    )
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    target = torch.softmax(logits[0], -1).numpy()
    assert _chi_square_p_value(np.bincount(tokens[offsets], minlength=V), target) > 1e-3
    # the second token, where the first was accepted, follows p' too (the rows do not depend on the prefix here)
    second = tokens[offsets[counts >= 2] + 1]
    assert _chi_square_p_value(np.bincount(second, minlength=V), target) > 1e-3


def test_seeded_rows_are_reproducible() -> None:
    logits = _masked_logits(40, seed=0)
    p = _rows(10, 3, 0.8)
    drafts = [np.array([0, 1, 2])] * 10
    first = verify(
        logits, p["num_logits"], drafts, p["temperature"], p["top_k"], p["top_p"], p["seeds"], p["sample_index"]
    )
    second = verify(
        logits, p["num_logits"], drafts, p["temperature"], p["top_k"], p["top_p"], p["seeds"], p["sample_index"]
    )
    assert first[0].tolist() == second[0].tolist() and first[1].tolist() == second[1].tolist()


def test_drafts_sampled_by_a_model_drafter_and_verified_with_their_q_keep_the_distribution() -> None:
    """DraftSampling (rank 0's draft choice) and verify together: the drafter samples from its own
    tempered, top-k distribution over a pruned vocabulary (draft id i is target id [0, 1, 2, 3, 5][i]),
    keeps q', and verification with that q' yields p' exactly."""
    from guidespec.protocol import StepInputs
    from guidespec.worker.drafting.draft_model import DraftSampling

    n = 20000
    ids = torch.tensor([0, 1, 2, 3, 5])  # the draft vocabulary misses the masked token 4
    torch.manual_seed(5)
    draft_logits = (torch.randn(1, 5) * 2).repeat(n, 1)
    inputs = StepInputs(
        step=1,
        slots=np.arange(n, dtype=np.int32),
        start_positions=np.zeros(n, np.int32),
        num_new_tokens=np.ones(n, np.int32),
        token_ids=np.zeros(n, np.int32),
        num_logits=np.ones(n, np.int32),
        temperature=np.full(n, 0.8, np.float32),
        top_k=np.full(n, 4, np.int32),
        top_p=np.ones(n, np.float32),
        seeds=np.full(n, -1, np.int64),
        sample_index=np.zeros(n, np.int32),
        num_prompt_tokens=np.ones(n, np.int32),
        penalties=np.ones((n, 3), np.float32),
    )
    sampling = DraftSampling(V)
    sampling.start()
    chosen = sampling.choose(draft_logits, np.arange(n), inputs, np.ones(n, np.int32), 0, lambda d: ids[d])
    drafts = [np.array([4])] + [np.array([t]) for t in chosen.tolist()[1:]]  # row 0: not the proposal
    q = sampling.draft_probs(inputs, drafts)
    assert q is not None and q[0] is None  # a draft that is not the kept proposal counts as one-hot
    assert all(row is not None and row.shape == (1, V) for row in q[1:10])
    assert sampling.draft_probs(inputs, drafts) is None  # kept q' serve one step only

    logits = _masked_logits(2 * n, seed=11)
    p = _rows(n, 1, 0.8)
    p["top_k"][:] = 4
    tokens, counts = verify(
        logits,
        p["num_logits"],
        drafts,
        p["temperature"],
        p["top_k"],
        p["top_p"],
        np.full(n, -1, np.int64),
        p["sample_index"],
        torch.Generator().manual_seed(0),
        q,
    )
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    from guidespec.worker.sampler import filtered_probs

    target = filtered_probs(logits[:1], torch.tensor([0.8]), torch.tensor([4]), torch.tensor([1.0]))[0].numpy()
    assert _chi_square_p_value(np.bincount(tokens[offsets], minlength=V), target) > 1e-3
    q0 = q[1][0].numpy()  # type: ignore[index]
    expected_acceptance = np.minimum(target, q0).sum()  # sum min(p', q'): higher than any one-hot draft's
    assert abs((counts == 2).mean() - expected_acceptance) < 0.02


def _padded(tokens: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    return [row[:c].tolist() for row, c in zip(tokens, counts)]


@pytest.mark.parametrize("drafts", [[0, 2], [2, 0], [MASKED, 1], [3, 3]])
def test_padded_verification_keeps_the_masked_distribution(drafts: list[int]) -> None:
    """verify_padded (a fused step's, on the device): each row's first token follows p' at its
    first position, and after an accepted first draft its second follows p' at the second; a
    forbidden draft is never accepted, a forbidden token never drawn; top-k narrows p'."""
    n = 40000
    torch.manual_seed(len(drafts) + drafts[0])
    base = torch.randn(3, V) * 1.5
    base[:, MASKED] = float("-inf")
    logits = base.repeat(n, 1)  # [n * 3, V]: every row the same three positions
    draft_rows = torch.tensor([drafts]).repeat(n, 1)
    for top_k in (0, 3):
        temperature = torch.full((n,), 0.8)
        uniforms = torch.rand(n, 2, 3, generator=torch.Generator().manual_seed(7 + top_k))
        sampling = (temperature, torch.full((n,), top_k), torch.ones(n), uniforms)
        tokens, counts = verify_padded(logits, draft_rows, torch.full((n,), 2), sampling)
        produced = _padded(tokens.numpy(), counts.numpy())
        p = torch.softmax(base / 0.8, -1)
        if top_k:
            p = torch.where(p >= p.topk(top_k, dim=-1).values[:, -1:], p, 0.0)
            p = p / p.sum(-1, keepdim=True)
        first = np.array([row[0] for row in produced])
        assert _chi_square_p_value(np.bincount(first, minlength=V), p[0].numpy()) > 1e-3
        second = np.array([row[1] for row in produced if len(row) > 1])  # after d1 was accepted
        if drafts[0] != MASKED and len(second) > 500:
            assert _chi_square_p_value(np.bincount(second, minlength=V), p[1].numpy()) > 1e-3
        accepted = (counts >= 2).float().mean().item()  # draft 1 accepted with probability p'(d1)
        expected = float(p[0, drafts[0]])
        assert abs(accepted - expected) < 4 * np.sqrt(max(expected * (1 - expected), 1e-6) / n) + 1e-9


def test_padded_verification_of_greedy_rows_and_dead_rows_is_verifys() -> None:
    """Greedy rows (beside a sampled one, or alone) give what verify gives; a row whose mask
    allows nothing at its last position gives NO_TOKEN there, and no draft is accepted into it."""
    torch.manual_seed(3)
    b, k = 5, 3
    logits = torch.randn(b * (k + 1), V)
    logits[(k + 1) * 4 + 1] = float("-inf")  # row 4's second position: nothing allowed
    best = logits.argmax(-1).view(b, k + 1)
    drafts = torch.stack([best[0, :k], best[1, :k], torch.tensor([best[2, 0], 5, 5]), best[3, :k], best[4, :k]])
    drafts[1, 2] = (drafts[1, 2] + 1) % V  # row 1: its third draft rejected
    drafts[4, 1] = 1  # (a draft other than the argmax of a dead row: 0)
    counts_in = torch.tensor([3, 3, 3, 2, 3])
    p = _rows(b, k, 0.0)
    expected = verify(
        logits.clone(),
        p["num_logits"],
        [d[:c].numpy() for d, c in zip(drafts, counts_in.tolist())],
        p["temperature"],
        p["top_k"],
        p["top_p"],
        p["seeds"],
        p["sample_index"],
    )
    for sampling in (None, "with a sampled row"):
        args = None
        if sampling:
            temperature = torch.zeros(b)  # (greedy rows: the sampling branch leaves them alone)
            args = (temperature, torch.zeros(b, dtype=torch.long), torch.ones(b), torch.rand(b, 2, k + 1))
        tokens, counts = verify_padded(logits, drafts, counts_in, args)
        flat = [t for row in _padded(tokens.numpy(), counts.numpy()) for t in row]
        assert flat == expected[0].tolist() and counts.tolist() == expected[1].tolist()
    assert _padded(tokens.numpy(), counts.numpy())[4] == [int(best[4, 0]), NO_TOKEN]


def test_padded_verification_without_drafts_samples_or_picks() -> None:
    """One logits row per row (a decode step without drafts): the argmax, or a draw."""
    logits = torch.tensor([[0.0, 9, 0, 0, 0, 0], [0, 0, 0, 9, 0, 0]])
    none = torch.zeros(2, 0, dtype=torch.long)
    tokens, counts = verify_padded(logits, none, torch.zeros(2, dtype=torch.long))
    assert tokens.tolist() == [[1], [3]] and counts.tolist() == [1, 1]
    sampling = (
        torch.tensor([0.0, 1.0]),
        torch.zeros(2, dtype=torch.long),
        torch.ones(2),
        torch.tensor([[[0.5], [0.5]], [[0.0], [0.0]]]),
    )
    tokens, counts = verify_padded(logits, none, torch.zeros(2, dtype=torch.long), sampling)
    assert tokens[0].tolist() == [1] and counts.tolist() == [1, 1] and 0 <= int(tokens[1, 0]) < V


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.8)])
def test_seeded_rows_verify_alike_step_by_step_and_padded(top_k: int, top_p: float) -> None:
    """A seeded row's numbers are its seed's (``seeded_uniforms``): ``verify`` (step by step) and
    ``verify_padded`` (fused) give it the same tokens, over rows that accept all, some or none of
    their drafts, forbidden drafts and rows without drafts among them."""
    torch.manual_seed(11)
    b, k = 300, 3
    base = torch.randn(4, V)  # (a peaked row: drafts often accepted; a flat one: often rejected)
    base[1] *= 4.0
    base[:, MASKED] = float("-inf")
    logits = base.repeat(b, 1)
    drafts = torch.randint(0, V, (b, k))
    drafts[::3] = base[:k].argmax(-1)  # every third row drafts the argmaxes
    counts_in = torch.randint(0, k + 1, (b,))
    seeds, first = np.arange(b, dtype=np.int64) * 7919, np.arange(b, dtype=np.int32) % 50
    p = _rows(b, k, 0.9)
    p["top_k"][:], p["top_p"][:] = top_k, top_p
    real = torch.cat([logits.view(b, k + 1, V)[i, : c + 1] for i, c in enumerate(counts_in.tolist())])
    flat, counts = verify(
        real,
        (counts_in + 1).numpy().astype(np.int32),
        [d[:c].numpy() for d, c in zip(drafts, counts_in.tolist())],
        p["temperature"],
        p["top_k"],
        p["top_p"],
        seeds,
        first,
    )
    uniforms = torch.from_numpy(seeded_uniforms(seeds, first, k + 1))
    sampling = (torch.full((b,), 0.9), torch.full((b,), top_k), torch.full((b,), top_p), uniforms)
    tokens, padded_counts = verify_padded(logits, drafts, counts_in, sampling)
    assert padded_counts.tolist() == counts.tolist()
    assert [t for row in _padded(tokens.numpy(), padded_counts.numpy()) for t in row] == flat.tolist()
    assert len(set(counts.tolist())) == k + 1  # (every number of accepted drafts occurred)


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_masks_left_unapplied_pick_as_applied_ones(kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy decode rows whose masks are left for the pick (the worker defers them on the CPU)
    and the other rows (drafts, sampling: applied first) give the tokens the masked logits give,
    with the CPU kernels and without (GUIDESPEC_CPU_KERNELS=0: torch applies them)."""
    from guidespec.worker.mask import apply_bitmask

    monkeypatch.setenv("GUIDESPEC_CPU_KERNELS", kernels)
    rng = np.random.default_rng(2)
    vocab, words = 100, 4
    rows = np.array([0, 1, 3])
    bitmask = rng.integers(-(2**31), 2**31, (3, words), dtype=np.int64).astype(np.int32)
    bitmask[1] = 0  # allows nothing: NO_TOKEN
    for num_logits, temperature in (
        (np.ones(4, np.int32), np.zeros(4, np.float32)),
        (np.array([1, 1, 2]), np.zeros(3, np.float32)),
    ):
        r = len(num_logits)
        logits = torch.from_numpy(rng.standard_normal((int(num_logits.sum()), vocab)).astype(np.float32))
        masked = logits.clone()
        apply_bitmask(masked, rows, bitmask)
        drafts = [
            np.array([int(masked[2].argmax())], np.int32) if n == 2 else np.array([], np.int32) for n in num_logits
        ]
        args = (
            num_logits,
            drafts,
            temperature,
            np.zeros(r, np.int32),
            np.ones(r, np.float32),
            np.full(r, -1),
            np.zeros(r, np.int32),
        )
        expected = verify(masked, *args)
        got = verify(logits, *args, unapplied=(rows, bitmask))
        assert [a.tolist() for a in got] == [a.tolist() for a in expected]
        assert NO_TOKEN in got[0].tolist()
