"""Exact verification of draft tokens on the workers (rank 0), after penalties and bitmasks.

A row that drafted ``k`` tokens ``d_1..d_k`` has ``k + 1`` logits rows: row ``j`` is the
target's distribution for the token after ``d_j`` (row 0: after the last accepted token), with
the grammar's mask for that position already applied (p'). Each row yields 1 to ``k + 1`` tokens:

- greedy: accept ``d_j`` while it equals the argmax of p'; then the argmax where they differ
  (or the bonus token after ``d_k``) — exactly the tokens plain greedy decoding would produce.
- sampling (rejection sampling, Leviathan et al. / Chen et al.): accept ``d_j`` with probability
  ``min(1, p'(d_j) / q'(d_j))``; at the first rejection draw from ``(p' - q')+`` normalised; when
  all are accepted draw a bonus token from the last row. Drafts from the scheduler (n-gram,
  grammar-forced, user) are deterministic: q' is one-hot, so acceptance is ``p'(d_j)`` and the
  residual is p' without ``d_j``. The output follows the masked target distribution exactly.

A draft the mask forbids has p'(d_j) = 0 and is never accepted: masks fail closed. A row whose
mask allows no token at all (a grammar the vocabulary cannot follow) yields ``NO_TOKEN``: the
scheduler fails that request alone.
Everything runs on the logits' device; only the chosen tokens (and argmaxes) travel back.
``verify_padded`` is the same for a fused step's fixed-shape rows (``step_graph.py``), on the
device without a host synchronisation: greedy rows, and sampled rows whose drafts are one-hot.
A seeded row's numbers are ``counter_uniforms`` of (seed, output index, purpose) in both: the
draft at output index ``i`` is accepted with ``ACCEPT``'s number at ``i``, and the token drawn at
``i`` uses ``DRAW``'s, so a seeded row gives the same tokens step by step or fused.
"""

from __future__ import annotations

import numpy as np
import torch

from guidespec.protocol import NO_TOKEN
from guidespec.worker.mask import apply_bitmask
from guidespec.worker.sampler import ACCEPT, DRAW, counter_uniforms, filtered_probs, inverse_cdf, sample


def verify(
    logits: torch.Tensor,
    num_logits: np.ndarray,
    drafts: list[np.ndarray],
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    seeds: np.ndarray,
    sample_index: np.ndarray,
    generator: torch.Generator | None = None,
    draft_probs: list[torch.Tensor | None] | None = None,
    unapplied: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens each row produces, flat, and how many per row.

    logits [sum(num_logits), V] fp32; per-row arrays of length B; ``drafts[b]`` has
    ``num_logits[b] - 1`` tokens; ``draft_probs[b]`` (model drafters) is q' [k, V] or None (one-hot).
    ``unapplied``: (logits rows, bitmask rows) of masks not yet applied to the logits: greedy
    decode rows read theirs as they pick (the CPU kernel); otherwise they are applied first.
    """
    batch = len(num_logits)
    if (num_logits == 1).all() and not temperature.any():  # greedy decode rows: their argmax, no loop
        return greedy_tokens(*_argmax_and_dead(logits, unapplied))
    if unapplied is not None:
        apply_bitmask(logits, *unapplied)
    best, dead = _argmax_and_dead(logits)  # [R] each: the greedy picks; rows whose mask allows nothing
    offsets = np.concatenate([[0], np.cumsum(num_logits)]).astype(np.int64)
    out: list[list[int]] = [[] for _ in range(batch)]
    if dead.any():  # sampled harmlessly (no nan), then replaced by NO_TOKEN below
        logits[torch.from_numpy(np.flatnonzero(dead)).to(logits.device)] = 0.0
    spec_rows = [b for b in range(batch) if num_logits[b] > 1]
    plain_rows = [b for b in range(batch) if num_logits[b] == 1 and temperature[b] != 0]
    for b in range(batch):
        if num_logits[b] == 1 and temperature[b] == 0:
            out[b] = [int(best[offsets[b]])]
    if plain_rows:  # no drafts, sampled: the ordinary sampler, batched
        index = offsets[plain_rows]
        plain_logits = logits if len(index) == logits.shape[0] else logits[index]  # no copy without drafts
        tokens = sample(
            plain_logits,
            torch.from_numpy(temperature[plain_rows].astype(np.float32)),
            torch.from_numpy(top_k[plain_rows].astype(np.int64)),
            torch.from_numpy(top_p[plain_rows].astype(np.float32)),
            torch.from_numpy(seeds[plain_rows].astype(np.int64)),
            torch.from_numpy(sample_index[plain_rows].astype(np.int64)),
            generator,
        )
        for b, token in zip(plain_rows, tokens.cpu().tolist()):
            out[b] = [token]
    picks = np.where(dead.astype(bool), NO_TOKEN, best)  # (a draft where nothing is allowed: never accepted)
    for b in spec_rows:
        if temperature[b] == 0:
            out[b] = _verify_greedy(picks[offsets[b] : offsets[b + 1]], drafts[b])
    sampled = [b for b in spec_rows if temperature[b] != 0]
    if sampled:
        index = np.concatenate([np.arange(offsets[b], offsets[b + 1]) for b in sampled])
        reps = num_logits[sampled]
        probs = filtered_probs(
            logits[index],
            torch.from_numpy(np.repeat(temperature[sampled], reps).astype(np.float32)),
            torch.from_numpy(np.repeat(top_k[sampled], reps).astype(np.int64)),
            torch.from_numpy(np.repeat(top_p[sampled], reps).astype(np.float32)),
        )
        # the seeded rows' numbers, all at once ([R, 2, n]: ACCEPT, DRAW; an unseeded row's are
        # its generator's, drawn in turn)
        numbers = seeded_uniforms(np.maximum(seeds[sampled], 0), sample_index[sampled], int(reps.max()))
        start = 0
        for i, (b, n) in enumerate(zip(sampled, reps.tolist())):
            q = draft_probs[b] if draft_probs is not None else None
            row_numbers = numbers[i] if seeds[b] >= 0 else None
            out[b] = _verify_sampled(probs[start : start + n], drafts[b], q, row_numbers, generator)
            start += n
    if dead.any():
        for b in range(batch):  # only a row's last token can come from a dead row (a draft accepted at
            if bool(dead[offsets[b] + len(out[b]) - 1]):  # a row had p' > 0 there)
                out[b][-1] = NO_TOKEN
    counts = np.array([len(t) for t in out], dtype=np.int32)
    flat = np.array([t for tokens in out for t in tokens], dtype=np.int32)
    return flat, counts


def verify_padded(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_count: torch.Tensor,
    sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify` for ``B`` rows of ``n`` logits rows each, of fixed shapes and without a host
    synchronisation (a fused step's graph, ``step_graph.py``): logits [B * n, V] (masked), drafts
    [B, n - 1] (each row's first ``draft_count[b]`` real). Returns (tokens [B, n]: each row's
    produced tokens first, NO_TOKEN where its mask allowed nothing; counts [B]).

    ``sampling``: (temperature [B] (0: greedy), top_k [B], top_p [B], uniforms [B, 2, n] in
    [0, 1)) where some row samples. A sampled row's drafts are deterministic (one-hot q': the
    model drafters draft greedily for every row where steps fuse), so draft ``j`` is accepted with
    probability p'(d_j), the first rejected one is replaced by a draw from p' without it, and a
    row whose drafts are all accepted draws its bonus token from its last row: the masked target
    distribution, exactly. ``uniforms[:, 0, j]`` decides draft ``j``; ``uniforms[:, 1, j]`` draws
    the token at position ``j`` (a seeded row's: :func:`seeded_uniforms`)."""
    b, n = drafts.shape[0], drafts.shape[1] + 1
    dead = torch.isneginf(logits.amax(dim=-1)).view(b, n)  # the mask allows nothing: NO_TOKEN, never a match
    best = torch.where(dead, NO_TOKEN, logits.argmax(dim=-1).view(b, n))
    real = torch.arange(n - 1, device=logits.device)[None, :] < draft_count[:, None]
    accepted = (drafts == best[:, :-1]) & real
    tokens = best
    if sampling is not None:
        temperature, top_k, top_p, uniforms = sampling
        safe = logits.masked_fill(dead.view(-1, 1), 0.0)  # (dead rows: finite, replaced below)
        probs = filtered_probs(
            safe,
            temperature.repeat_interleave(n),
            top_k.repeat_interleave(n),
            top_p.repeat_interleave(n),
            always_filter=True,
        ).view(b, n, -1)
        sampled = temperature > 0
        p_draft = probs[:, :-1].gather(-1, drafts.clamp(min=0)[..., None]).squeeze(-1)  # [B, n - 1]
        drawn_accept = (uniforms[:, 0, : n - 1] < p_draft) & real & ~dead[:, :-1]
        accepted = torch.where(sampled[:, None], drawn_accept, accepted)
    count = accepted.long().cumprod(dim=1).sum(dim=1)  # accepted drafts
    rows = torch.arange(b, device=logits.device)
    if sampling is not None:
        last = probs[rows, count]  # [B, V]: the distribution of the token after the accepted drafts
        padded = torch.cat([drafts, drafts.new_zeros(b, 1)], dim=1).clamp(min=0)
        rejected = (count < draft_count)[:, None]
        residual = torch.where(rejected, last.scatter(1, padded[rows, count][:, None], 0.0), last)
        total = residual.sum(dim=-1, keepdim=True)
        residual = torch.where(total > 0, residual, last)  # (nothing left: draw from p')
        drawn = inverse_cdf(residual, uniforms[:, 1].gather(1, count[:, None]).squeeze(1))
        own = padded.scatter(1, count[:, None], drawn[:, None])  # the accepted drafts, then the drawn token
        tokens = torch.where(sampled[:, None], own, best)
    final_dead = dead[rows, count]
    tokens = tokens.scatter(1, count[:, None], torch.where(final_dead, NO_TOKEN, tokens[rows, count])[:, None])
    return tokens, count + 1


def greedy_tokens(best: np.ndarray, dead: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`verify`'s answer for greedy decode rows of these picks (``_argmax_and_dead``'s): each
    row's pick, ``NO_TOKEN`` where its row is dead; one token a row."""
    flat = best.astype(np.int32)
    flat[dead.astype(bool)] = NO_TOKEN
    return flat, np.ones(len(flat), dtype=np.int32)


def _argmax_and_dead(
    logits: torch.Tensor, unapplied: tuple[np.ndarray, np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's argmax, and whether the row is all -inf, as NumPy arrays: one pass of the CPU
    kernel (kernels/logits_ops.c: ``unapplied`` masks read as it picks), or torch on the logits'
    device (only the answers travel back)."""
    from guidespec.worker import kernels

    picked = kernels.argmax_rows(logits, unapplied)
    if picked is not None:
        return picked
    if unapplied is not None:  # (no kernel: the masks applied as any device does)
        apply_bitmask(logits, *unapplied)
    return logits.argmax(dim=-1).cpu().numpy(), torch.isneginf(logits).all(dim=-1).cpu().numpy()


def accept_greedy(picks: np.ndarray, num_logits: np.ndarray, drafts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`verify` of greedy rows whose picks are made (one per logits row, ``NO_TOKEN`` where
    a mask allows nothing: ``worker.greedy_masked``'s): each row's drafts accepted while they
    equal its picks, then its pick where they differ (or its bonus pick); a row without logits
    rows (a prompt's chunk before its last), nothing. A dead pick equals no draft: the row ends
    with ``NO_TOKEN`` there. (Tokens flat, and how many per row.)"""
    offsets = np.concatenate([[0], np.cumsum(num_logits)]).tolist()
    out = [
        _verify_greedy(picks[offsets[b] : offsets[b + 1]], drafts[b]) if n else []
        for b, n in enumerate(num_logits.tolist())
    ]
    counts = np.array([len(t) for t in out], dtype=np.int32)
    return np.array([t for tokens in out for t in tokens], dtype=np.int32), counts


def _verify_greedy(best: np.ndarray, drafts: np.ndarray) -> list[int]:
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == best[accepted]:
        accepted += 1
    return [int(t) for t in drafts[:accepted]] + [int(best[accepted])]


def seeded_uniforms(seeds: np.ndarray, first_index: np.ndarray, n: int) -> np.ndarray:
    """The numbers of :func:`verify_padded`'s ``uniforms`` for seeded rows, [R, 2, n] float32:
    (``ACCEPT``, ``DRAW``) at output indices ``first_index + j``, as :func:`verify` uses them."""
    index = first_index.astype(np.int64)[:, None] + np.arange(n)
    seeds = seeds.astype(np.int64)[:, None]
    return np.stack([counter_uniforms(seeds, index, ACCEPT), counter_uniforms(seeds, index, DRAW)], axis=1)


def _verify_sampled(
    probs: torch.Tensor,
    drafts: np.ndarray,
    q: torch.Tensor | None,
    numbers: np.ndarray | None,
    generator: torch.Generator | None,
) -> list[int]:
    """A sampled row's drafts accepted or corrected; ``numbers`` [2, >= len(drafts) + 1] are a
    seeded row's (ACCEPT, DRAW) at its output indices (``seeded_uniforms``), None where the row
    is unseeded (its numbers come from ``generator``)."""
    tokens: list[int] = []
    for j, draft in enumerate(drafts.tolist()):
        p = probs[j]
        q_draft = float(q[j, draft]) if q is not None else 1.0
        u = float(torch.rand(1, generator=generator, device=p.device)) if numbers is None else float(numbers[0, j])
        if q_draft > 0 and u * q_draft < float(p[draft]):  # u < p'/q', without dividing
            tokens.append(draft)
            continue
        residual = (p - q[j].to(p.device)).clamp(min=0) if q is not None else p.clone()
        if q is None:
            residual[draft] = 0
        if float(residual.sum()) <= 0:  # p' == q': nothing left to correct, draw from p'
            residual = p
        tokens.append(_draw_one(residual, numbers, j, generator))
        return tokens
    tokens.append(_draw_one(probs[len(drafts)], numbers, len(drafts), generator))
    return tokens


def _draw_one(weights: torch.Tensor, numbers: np.ndarray | None, j: int, shared: torch.Generator | None) -> int:
    if numbers is None:
        return int(torch.multinomial(weights, 1, generator=shared))
    return int(inverse_cdf(weights[None], torch.from_numpy(numbers[1, j : j + 1]))[0])
