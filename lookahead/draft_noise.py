"""Noise-aware drafting under seeded sampling.

The seeded rule (`rules.SeededRule`) emits at sequence index t the token argmax(log p_t + g_t), where the Gumbel
noise g_t is a pure function of (seed, t) (`sampling.gumbel_noise`) — known before the target has scored
anything. A drafter that knows roughly what the target will predict (token recycling keeps each token's top-k
logits) can therefore rank candidates the way the draw will: by logit / temperature + g_t instead of by logit.
The drafts only propose; verification is unchanged, so the output stays exactly the seeded draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from transformers import TemperatureLogitsWarper

from .sampling import gumbel_noise


@dataclass(frozen=True)
class DraftNoise:
    """The noise of the indices after a root: rows [D, V] float32 (row d - 1: the token at depth d), and the
    1 / temperature that scales raw logits before the noise is added."""

    rows: np.ndarray
    inv_temp: float


class SeededDraftNoise:
    """One sequence's noise for drafting: `at(root_index)` gives the noise of indices root_index + 1 ..
    root_index + depth. Rows are kept as the root moves forward, so each index's noise is drawn once here (and
    `sampling.gumbel_noise` caches it for the verifying walk)."""

    def __init__(self, seed: int, vocab: int, depth: int, temperature: float):
        self.seed = seed
        self.inv_temp = 1.0 / temperature
        self._rows = np.empty((depth, vocab), dtype=np.float32)  # [D, V]
        self._first: int | None = None  # the sequence index of row 0

    def at(self, root_index: int) -> DraftNoise:
        """The noise of the `depth` indices after `root_index` (the root token's index, prompt included)."""
        first, depth = root_index + 1, self._rows.shape[0]
        kept = 0
        if self._first is not None and 0 <= first - self._first < depth:
            kept = depth - (first - self._first)
            self._rows[:kept] = self._rows[depth - kept:]  # numpy copies overlapping slices correctly
        for row in range(kept, depth):
            self._rows[row] = gumbel_noise(self.seed, first + row, self._rows.shape[1]).numpy()
        self._first = first
        return DraftNoise(self._rows, self.inv_temp)


def sampling_temperature(processors) -> float:
    """The temperature among a generation's logits processors (`TemperatureLogitsWarper`; 1.0 without one)."""
    for processor in processors:
        if isinstance(processor, TemperatureLogitsWarper):
            return float(processor.temperature)
    return 1.0
