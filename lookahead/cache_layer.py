"""A KV-cache layer that appends into preallocated storage instead of re-concatenating the whole cache.

transformers' `DynamicLayer.update` runs `torch.cat([cached, new])` on every forward, copying every cached slot of
every layer once per step: 4–5% of a verification step at 800 cached tokens on the default model
(`benchmarks/bench_step.py`). `SlabLayer` keeps the states in a larger buffer (the slab) and exposes
`keys`/`values` as views of its first slots, so an append copies only the new rows, and cropping or an in-place
compaction (`cache.keep_rows`) keeps using the slab. It is a `DynamicLayer` (same states, same API); whenever
`keys` stops being a prefix view of the slab (an outside `index_select`, `batch_select_indices`, ...), the next
append moves the states into a fresh slab. The attention reads the same numbers, so logits are unchanged.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

MIN_HEADROOM = 256  # slots added beyond what an append needs, at least (and half the length, at most doubling)


class SlabLayer(DynamicLayer):
    """A `DynamicLayer` whose appends write into preallocated storage (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._key_slab: torch.Tensor | None = None
        self._value_slab: torch.Tensor | None = None
        self._views: tuple = (None, None)  # the keys and values views the last append set

    @classmethod
    def holding(cls, layer: DynamicLayer) -> "SlabLayer":
        """A `SlabLayer` holding `layer`'s states (moved into a slab at its next append)."""
        slab = cls()
        if layer.is_initialized:
            slab.lazy_initialization(layer.keys, layer.values)
            slab.keys, slab.values = layer.keys, layer.values
        return slab

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `[B, H, T, D]` key/value states; return all cached keys and values (views of the slab)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cached = self.get_seq_length()
        needed = cached + key_states.shape[-2]
        self._reserve(key_states, value_states, needed)
        self._key_slab[:, :, cached:needed].copy_(key_states)
        self._value_slab[:, :, cached:needed].copy_(value_states)
        return self.keys, self.values

    def reserve(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend `keys`/`values` by `rows` slots whose contents the caller writes (a layer holding states only);
        returns the key and value slabs `[B, H, capacity, D]`, the new slots at `cached … cached + rows - 1`."""
        self._reserve(self.keys, self.values, self.get_seq_length() + rows)
        return self._key_slab, self._value_slab

    def _reserve(self, key_like: torch.Tensor, value_like: torch.Tensor, needed: int) -> None:
        """Make the slabs hold `needed` slots (a fresh slab, the cached states copied, when they do not) and
        point `keys`/`values` at the first `needed`."""
        if not (self._in_slab() and needed <= self._key_slab.shape[-2]):
            cached = self.get_seq_length()
            capacity = needed + max(MIN_HEADROOM, needed // 2)
            self._key_slab = _new_slab(self.keys, key_like, cached, capacity)
            self._value_slab = _new_slab(self.values, value_like, cached, capacity)
        self.keys = self._key_slab[:, :, :needed]
        self.values = self._value_slab[:, :, :needed]
        self._views = (self.keys, self.values)

    def _in_slab(self) -> bool:
        """Whether `keys` and `values` are still views of the slabs' first slots (nothing replaced them): at once
        when they are the very views the last append made (no outside code changes a view's shape in place),
        else by their storage and layout."""
        if self._key_slab is None:
            return False
        if self.keys is self._views[0] and self.values is self._views[1]:
            return True
        return (self.get_seq_length() > 0
                and _prefix_view(self.keys, self._key_slab) and _prefix_view(self.values, self._value_slab))


def _prefix_view(states: torch.Tensor, slab: torch.Tensor) -> bool:
    """Whether `states` is `slab[:, :, :n]` for some n."""
    return (states.data_ptr() == slab.data_ptr() and states.shape[:2] == slab.shape[:2]
            and states.shape[3:] == slab.shape[3:] and states.stride() == slab.stride())


def _new_slab(cached: torch.Tensor, new: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
    """A `[B, H, capacity, D]` buffer like `new`, its first `length` slots a copy of `cached`."""
    slab = new.new_empty(new.shape[:2] + (capacity,) + new.shape[3:])
    if length:
        slab[:, :, :length].copy_(cached)
    return slab
