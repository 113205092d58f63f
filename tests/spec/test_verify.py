"""Verification of drafts (rank 0): greedy equals plain greedy decoding; rejection sampling keeps
the masked target distribution exactly, for one-hot (scheduler) drafts and model drafts alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from guidespec.spec.verify import verify

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
    from guidespec.spec.draft_model import DraftSampling

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
