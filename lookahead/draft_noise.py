"""Noise-aware drafting under seeded sampling.

The seeded rule (`rules.SeededRule`) emits at sequence index t the token argmax(log p_t + g_t), where the Gumbel
noise g_t is a pure function of (seed, t, token) (`gumbel.py`) — known before the target has scored
anything. A drafter that knows roughly what the target will predict (token recycling keeps each token's top-k
logits) can therefore rank candidates the way the draw will: by logit / temperature + g_t instead of by logit.
The drafts only propose; verification is unchanged, so the output stays exactly the seeded draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from transformers import TemperatureLogitsWarper

from .gumbel import index_key


@dataclass(frozen=True)
class DraftNoise:
    """The noise of the indices after a root: keys [D] uint64 (key d - 1: the token at depth d; its noise for a
    token is `gumbel.gumbel_of(key, token)`), and the 1 / temperature that scales raw logits before the noise is
    added."""

    keys: np.ndarray
    inv_temp: float


class SeededDraftNoise:
    """One sequence's noise for drafting: `at(root_index)` gives the noise keys of indices root_index + 1 ..
    root_index + depth, the keys the seeded rule's draws at those indices use."""

    def __init__(self, seed: int, depth: int, temperature: float):
        self.seed, self.depth = seed, depth
        self.inv_temp = 1.0 / temperature

    def at(self, root_index: int) -> DraftNoise:
        """The noise of the `depth` indices after `root_index` (the root token's index, prompt included)."""
        keys = np.array([index_key(self.seed, root_index + 1 + d) for d in range(self.depth)], dtype=np.uint64)
        return DraftNoise(keys, self.inv_temp)


def sampling_temperature(processors) -> float:
    """The temperature among a generation's logits processors (`TemperatureLogitsWarper`; 1.0 without one)."""
    for processor in processors:
        if isinstance(processor, TemperatureLogitsWarper):
            return float(processor.temperature)
    return 1.0
