"""RoPE's factors for a step read from a table the model's own rotary module computed once, not recomputed per step.

A fused stack step (`fused_stack`) needs, per row, `cos` and the sin with its first half negated ("folded", where
`rotate_half` puts its minus sign). Asking the model's rotary module every step (positions times frequencies, a
concatenation, cos, sin, a scaling, the fold) took 0.29 ms of a one-row step in situ (median of 570 steps, AVX2, 2
threads: every operation runs on caches the weight stream has just flushed); the table's gather takes 0.08 ms. For
the default RoPE ("default" rope type: fixed frequencies, no scaling that depends on the sequence) every factor
depends only on its position, element by element, so `RopeTable` asks the module once for positions 0 … L-1 (L
doubling as needed) and a step gathers its rows.

Nothing is assumed: a table is kept only when the module, asked again for a few positions on their own and in a
short run, gives the table's rows bit for bit; the frequencies' identity and version are checked every step (a
changed buffer makes a new table). Any other rotary module (dynamic, YaRN, long-RoPE types, a replaced forward),
or one with hooks, is left to compute every step. `fold_sin` (the fold itself) serves `lean_layers.FoldedRotary` too.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

MIN_POSITIONS = 256  # the first table's length: a table grows to twice its length (or to the position asked for)


class RopeTable:
    """(cos, folded sin) rows `[T, D]` float32 for given positions, from the table of `rotary` (see the module
    docstring); `factors` returns None where the table is not used."""

    def __init__(self, rotary: nn.Module):
        self.rotary = rotary
        self.usable = (getattr(rotary, "rope_type", None) == "default" and "forward" not in rotary.__dict__
                       and isinstance(getattr(rotary, "inv_freq", None), torch.Tensor))
        self._key: tuple | None = None  # (inv_freq identity, its version) the table was built from
        self._cos = self._folded = None

    def factors(self, position_ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
        """(cos, folded sin), each float32 `[B · T, D]` contiguous, for `position_ids` `[B, T]` (row b · T + t for
        position_ids[b, t]); None when this rotary module has no table (or the module's output for these positions
        would not be the table's)."""
        if not self.usable or self.rotary._forward_hooks or self.rotary._forward_pre_hooks:
            return None
        positions = position_ids.reshape(-1).numpy()
        if not len(positions) or positions.min() < 0:
            return None
        needed = int(positions.max()) + 1
        inv_freq = self.rotary.inv_freq
        key = (id(inv_freq), inv_freq._version)
        fresh = self._cos is not None and key == self._key
        if not fresh or needed > len(self._cos):
            if not self._build(max(needed, MIN_POSITIONS, 2 * len(self._cos) if fresh else 0)):
                return None
            self._key = key
        return self._cos[positions], self._folded[positions]

    @torch.no_grad()
    def _build(self, length: int) -> bool:
        """Build the table for positions 0 … length-1 from the module; False (and no table used again) when the
        module's output for positions asked on their own or in a short run is not the table's, bit for bit."""
        cos, folded = self._ask(torch.arange(length)[None])
        probes = [torch.tensor([[0]]), torch.tensor([[length - 1]]), torch.arange(length // 2, length // 2 + 5)[None]]
        for probe in probes:
            probe = probe[:, probe[0] < length]
            rows = probe[0].numpy()
            probe_cos, probe_folded = self._ask(probe)
            if not (np.array_equal(probe_cos, cos[rows]) and np.array_equal(probe_folded, folded[rows])):
                self.usable = False
                return False
        self._cos, self._folded = cos, folded
        return True

    def _ask(self, position_ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The module's (cos, folded sin) for `position_ids` `[1, T]`, as float32 numpy `[T, D]`."""
        probe = torch.zeros(1, dtype=torch.float32)  # the module reads only its dtype and device
        cos, sin = self.rotary(probe, position_ids=position_ids)
        return cos[0].float().contiguous().numpy(), fold_sin(sin)[0].float().contiguous().numpy()


def fold_sin(sin: torch.Tensor) -> torch.Tensor:
    """RoPE's sin `[..., D]` with its first half negated: `rotate_half(x) * sin` = `x.roll(D / 2) * fold_sin(sin)`
    for Llama's `rotate_half(x) = cat(-x2, x1)`."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
