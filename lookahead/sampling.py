"""Distributions, plain draws and noise for exact sampling: probabilities from processed scores, one draw by the
inverse CDF, and the Gumbel noise of reproducible (seeded) sampling keyed by (seed, sequence index, token)
(`gumbel.py`).

Pure functions of tensors; the verification walks that use them (point-mass rejection, min(1, p/q), seeded
Gumbel-max over a draft tree) live in `verify.py`.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .gumbel import noise_of, noise_of_vocab

_MASK64 = (1 << 64) - 1
# `sample_seeded` scores only the tokens with mass when they are at most 1 / this of the vocabulary.
_SPARSE_FRACTION = 4


def probs_from_scores(scores: torch.Tensor) -> torch.Tensor:
    """Softmax of processed scores [..., V] -> probabilities [..., V] (float32, or float64 if given float64).

    Tokens masked to -inf by top-k/top-p/min-p/bad-words get probability exactly 0. Raises `ValueError` if a
    row has no finite maximum (every token masked, or a nan/+inf score): no distribution exists then.
    """
    scores = scores if scores.dtype == torch.float64 else scores.float()
    if not torch.isfinite(scores.amax(dim=-1)).all():
        raise ValueError("scores row has every token masked to -inf (or holds nan/+inf): nothing to sample")
    return torch.softmax(scores, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from `probs` [V] (nonnegative, positive sum): inverse CDF at one float64 uniform from `generator`
    (any device), the only source of randomness."""
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device).item()
    return inverse_cdf(probs.to(torch.float64), u)


def inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """Index i with cdf[i-1] <= u * total < cdf[i] for nonnegative `weights` [V] with a positive sum: a draw
    proportional to `weights` when u ~ U[0, 1). (torch.multinomial draws V exponentials: ~6 ms at V = 49k here.)
    """
    cdf = weights.cumsum(0)  # [V]
    index = int(torch.searchsorted(cdf, u * cdf[-1].item(), right=True))
    if index == weights.shape[0]:  # u * total rounded up to total (probability ~2**-53): last token with mass
        index = int(weights.nonzero()[-1])
    return index


def gumbel_noise(seed: int, index: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard Gumbel noise [vocab] (float64) for the token at sequence index `index`, a pure function of
    (seed, index, token) (`gumbel.py`: a hash, so any subset of tokens can be computed alone, `noise_at`).

    Computed on the CPU and then moved to `device`, so it is the same on every device. Raises `ValueError` for
    a negative `index` or a `seed` outside [0, 2**64).
    """
    _check_key(seed, index)
    return _cpu_gumbel_noise(seed, index, vocab).to(device, copy=True)  # a copy: callers may write to it


def noise_at(seed: int, index: int, tokens: torch.Tensor) -> torch.Tensor:
    """The Gumbel noise [n] (float64, CPU) of `tokens` ([n] int64) at sequence index `index`: the entries
    `gumbel_noise(seed, index, V)[tokens]`, computed for those tokens alone. Raises as `gumbel_noise`."""
    _check_key(seed, index)
    return torch.from_numpy(noise_of(seed, index, tokens.cpu().numpy()))


def _check_key(seed: int, index: int) -> None:
    """Raise `ValueError` unless 0 <= seed < 2**64 and index >= 0."""
    if not 0 <= seed <= _MASK64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")


@lru_cache(maxsize=16)
def _cpu_gumbel_noise(seed: int, index: int, vocab: int) -> torch.Tensor:
    """`gumbel_noise` on the CPU, remembered for the last 16 (seed, index, vocab): siblings share their index, so
    a walk over a dense distribution reads one index's noise several times. Callers must not modify it."""
    return torch.from_numpy(noise_of_vocab(seed, index, vocab))


def gumbel_scores(probs: torch.Tensor, seed: int, index: int) -> torch.Tensor:
    """log probs + g_index [V] (float64): its argmax is a sample from `probs` [V] (Gumbel-max trick).

    Tokens with probability 0 score -inf and are never drawn.
    """
    return probs.to(torch.float64).log() + gumbel_noise(seed, index, probs.shape[-1], probs.device)


def sample_seeded(probs: torch.Tensor, seed: int, index: int) -> int:
    """Reproducible draw from `probs` [V] for the token at sequence index `index` (prompt included): the argmax
    of `gumbel_scores(probs, seed, index)`.

    The seeded walk (`verify.verify_seeded`) emits exactly this draw at every index it visits. On the CPU, when
    top-k/top-p left few tokens with mass, only those are scored, with their noise alone (`noise_at`): the others
    score -inf and never win, and the support's indices ascend, so the first maximum is the same token (~0.07 ms
    with 170 tokens of mass at V = 49k, instead of ~0.7 ms). Raises `ValueError` for a bad seed or index
    (`gumbel_noise`).
    """
    if probs.device.type == "cpu" and probs.dim() == 1:
        support = probs.nonzero().view(-1)  # [S] ascending
        if 0 < support.numel() <= probs.shape[0] // _SPARSE_FRACTION:
            scores = probs.index_select(0, support).to(torch.float64).log() + noise_at(seed, index, support)
            return int(support[scores.argmax()])
    return int(gumbel_scores(probs, seed, index).argmax())
