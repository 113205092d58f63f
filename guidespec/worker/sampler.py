"""Turning logits rows into tokens: greedy, temperature, top-k, top-p, per-request seeds.

Every tensor op runs on the logits' device (the CPU, or rank 0's GPU: only the tokens travel
back). Seeded rows draw from a generator seeded by (request seed, index of the token in the
output), on that device, so a seeded request gives the same tokens whatever batch it shares and
however its steps are cut. Bitmasks (guided decoding) are applied before this, by the caller.
"""

from __future__ import annotations

import torch

_SEED_STRIDE = 1_000_003
# a temperature below this samples as if it were this: fp32 logits / temperature stay finite
# (a valid request may ask for 1e-30; dividing by it would give inf - inf = nan in the softmax)
_MIN_TEMPERATURE = 1e-4


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    sample_index: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [R, V] fp32; per-row parameters [R]. Returns token ids [R] int64."""
    greedy = temperature == 0
    tokens = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return tokens
    rows = (~greedy).nonzero().flatten()
    probs = filtered_probs(logits[rows.to(logits.device)], temperature[rows], top_k[rows], top_p[rows])
    tokens[rows.to(logits.device)] = _draw(probs, seeds[rows].cpu(), sample_index[rows].cpu(), generator)
    return tokens


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    always_filter: bool = False,
) -> torch.Tensor:
    """Each row's distribution under its temperature, top-k and top-p. ``always_filter`` sorts
    every row whatever its parameters (no host synchronisation: capturable in a CUDA graph)."""
    device = logits.device
    temperature, top_k, top_p = temperature.to(device), top_k.to(device), top_p.to(device)
    logits = logits / temperature.clamp(min=_MIN_TEMPERATURE)[:, None]
    vocab = logits.shape[-1]
    if always_filter or bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        ranks = torch.arange(vocab, device=device)[None]
        drop = ranks >= k[:, None]
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop |= (cumulative - sorted_logits.softmax(dim=-1)) >= top_p[:, None]
        drop[:, 0] = False  # even where a tiny top_p rounds to 0 in fp32
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.softmax(dim=-1)


def _draw(
    probs: torch.Tensor, seeds: torch.Tensor, sample_index: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    unseeded = (seeds < 0).nonzero().flatten()
    if len(unseeded):
        out[unseeded.to(probs.device)] = torch.multinomial(
            probs[unseeded.to(probs.device)], 1, generator=generator
        ).flatten()
    for row in (seeds >= 0).nonzero().flatten().tolist():
        g = torch.Generator(device=probs.device).manual_seed(
            (int(seeds[row]) * _SEED_STRIDE + int(sample_index[row])) % 2**63
        )
        out[row] = torch.multinomial(probs[row], 1, generator=g).item()
    return out
