"""Turning logits rows into tokens: greedy, temperature, top-k, top-p, per-request seeds.

Every tensor op runs on the logits' device (the CPU, or rank 0's GPU: only the tokens travel
back). Unseeded rows draw from the worker's generator. A seeded row's random numbers are a
counter-based function of (request seed, index of the token in the output, purpose)
(:func:`counter_uniforms`), so a seeded request gives the same tokens whatever batch it shares,
however its steps are cut, and whether its step runs step by step or fused in a graph (where
the numbers are computed on the host and copied in with the step's other inputs, ``step_graph.py``).
Bitmasks (guided decoding) are applied before this, by the caller.
"""

from __future__ import annotations

import numpy as np
import torch

# purposes of a seeded row's random numbers: each its own stream of counter_uniforms
DRAW = 0  # the token at an output index (a plain step's, or a verify step's first rejected or bonus one)
ACCEPT = 1  # the acceptance test of the draft at an output index
DRAFT = 2  # a model drafter's draw of the draft at an output index
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
        # (top_p 1 keeps every token: a cumulative sum that rounds up to 1 drops no tail)
        drop |= ((cumulative - sorted_logits.softmax(dim=-1)) >= top_p[:, None]) & (top_p < 1)[:, None]
        drop[:, 0] = False  # even where a tiny top_p rounds to 0 in fp32
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.softmax(dim=-1)


def counter_uniforms(seeds: np.ndarray, index: np.ndarray, stream: int) -> np.ndarray:
    """Uniform numbers in [0, 1) (float32, 24 random bits) as a function of (seed, index, stream),
    elementwise over the broadcast of ``seeds`` (int64, >= 0) and ``index`` (>= 0): SplitMix64's
    output at position ``index`` of a sequence whose start is the mix of (seed, stream), so one
    seed and stream never repeat a state over 2**64 indices. Host arithmetic in uint64, whose
    wrapping NumPy defines for arrays."""
    seed_words, index_words = np.broadcast_arrays(np.asarray(seeds, dtype=np.int64), np.asarray(index, dtype=np.int64))
    shape = seed_words.shape
    start = _mix64(seed_words.ravel().astype(np.uint64) ^ _mix64(np.full(1, stream + 1, dtype=np.uint64)))
    state = start + (index_words.ravel().astype(np.uint64) + np.uint64(1)) * _GOLDEN
    return ((_mix64(state) >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)).reshape(shape)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (a bijection of uint64), on 1-d arrays (NumPy's scalars would warn
    where arrays wrap)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """A token per row of ``weights`` [R, V] (>= 0, not normalised, some > 0), drawn with
    ``uniforms`` [R] in [0, 1): the first token whose cumulative weight passes u x the total.
    Host-synchronisation free (capturable); every path that draws with given numbers uses it, so
    they draw alike."""
    cdf = weights.cumsum(dim=-1)
    point = uniforms.to(weights.device, weights.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, point, right=True).clamp(max=cdf.shape[-1] - 1).flatten()


def _draw(
    probs: torch.Tensor, seeds: torch.Tensor, sample_index: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    unseeded = (seeds < 0).nonzero().flatten()
    if len(unseeded):  # (inverse_cdf, not torch.multinomial: 18 against 330 ms for 16 rows of 262k tokens)
        rows = unseeded.to(probs.device)
        device = generator.device if generator is not None else probs.device
        out[rows] = inverse_cdf(probs[rows], torch.rand(len(rows), generator=generator, device=device))
    seeded = (seeds >= 0).nonzero().flatten()
    if len(seeded):
        counted = counter_uniforms(seeds[seeded].numpy(), sample_index[seeded].numpy(), DRAW)
        rows = seeded.to(probs.device)
        out[rows] = inverse_cdf(probs[rows], torch.from_numpy(counted))
    return out
