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
    """A `DynamicLayer` whose appends write into preallocated storage (see the module docstring).

    While the states live in the slabs, the layer keeps only how many slots it holds: `keys` / `values` are views
    of the slabs' first slots made when read (a step's fused forward appends to all 30 layers of the default
    model without making 60 views, ~0.5 ms), and a crop only lowers the count. A tensor assigned to `keys` or
    `values` that is such a prefix view sets the count; any other tensor is held as it is (not in the slab).
    """

    def __init__(self) -> None:
        self._key_slab: torch.Tensor | None = None
        self._value_slab: torch.Tensor | None = None
        self._lengths = [0, 0]  # slots in use of the key and the value slab
        self._held: list = [None, None]  # keys / values when not in the slab (None: they are)
        self._views: list = [None, None]  # the views of the slabs' first slots last made (None: none yet)
        super().__init__()  # sets keys and values to None: held, not in the slab

    @property
    def keys(self) -> torch.Tensor | None:
        """The cached keys `[B, H, slots, D]`."""
        return self._get(0)

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._set(0, tensor)

    @property
    def values(self) -> torch.Tensor | None:
        """The cached values `[B, H, slots, D]`."""
        return self._get(1)

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._set(1, tensor)

    def _slab(self, which: int) -> torch.Tensor | None:
        """The key (0) or value (1) slab, if any."""
        return self._key_slab if which == 0 else self._value_slab

    def _get(self, which: int) -> torch.Tensor | None:
        """Keys (0) or values (1): the held tensor, or the slab's first slots (a view made once per length)."""
        if self._held[which] is not None or self._slab(which) is None:
            return self._held[which]
        view = self._views[which]
        if view is None or view.shape[2] != self._lengths[which]:
            view = self._views[which] = self._slab(which)[:, :, :self._lengths[which]]
        return view

    def _set(self, which: int, tensor: torch.Tensor | None) -> None:
        """Assign keys (0) or values (1): a prefix view of the slab sets the slot count, anything else is held
        (None, as `reset` assigns, also lets the slab go)."""
        slab = self._slab(which)
        if tensor is not None and slab is not None and _prefix_view(tensor, slab):
            self._held[which], self._views[which], self._lengths[which] = None, tensor, tensor.shape[2]
            return
        self._held[which], self._views[which] = tensor, None
        if tensor is None:
            if which == 0:
                self._key_slab = None
            else:
                self._value_slab = None

    @classmethod
    def holding(cls, layer: DynamicLayer) -> "SlabLayer":
        """A `SlabLayer` holding `layer`'s states (moved into a slab at its next append)."""
        return cls.of(layer.keys, layer.values) if layer.is_initialized else cls()

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor) -> "SlabLayer":
        """A `SlabLayer` holding `keys` and `values` `[B, H, slots, D]` (moved into a slab at its next append)."""
        slab = cls()
        slab.lazy_initialization(keys, values)
        slab.keys, slab.values = keys, values
        return slab

    def get_seq_length(self) -> int:
        """The number of cached slots."""
        if self._in_slab():
            return self._lengths[0]
        return super().get_seq_length()

    @property
    def batch_size(self) -> int:
        """The number of sequences cached (the layer must be initialized)."""
        return self._key_slab.shape[0] if self._in_slab() else self.keys.shape[0]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` slots (as `DynamicLayer.crop`); in the slab, only the count moves."""
        if not (self._in_slab() and self.is_initialized) or tokens_to_remove > 0:
            super().crop(tokens_to_remove)
            return
        length = max(0, self._lengths[0] + tokens_to_remove)
        self._lengths = [length, length]

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
        if self._in_slab():
            needed = self._lengths[0] + rows
            if needed <= self._key_slab.shape[2]:
                self._lengths = [needed, needed]
                return self._key_slab, self._value_slab
        self._reserve(self.keys, self.values, self.get_seq_length() + rows)
        return self._key_slab, self._value_slab

    def _reserve(self, key_like: torch.Tensor, value_like: torch.Tensor, needed: int) -> None:
        """Make the slabs hold `needed` slots (a fresh slab, the cached states copied, when they do not) and
        count `needed` slots in use."""
        if not (self._in_slab() and needed <= self._key_slab.shape[-2]):
            cached = self.get_seq_length()
            capacity = needed + max(MIN_HEADROOM, needed // 2)
            key_slab = _new_slab(self.keys, key_like, cached, capacity)
            value_slab = _new_slab(self.values, value_like, cached, capacity)
            self._key_slab, self._value_slab = key_slab, value_slab
            self._held, self._views = [None, None], [None, None]
        self._lengths = [needed, needed]

    def _in_slab(self) -> bool:
        """Whether the keys and values live in the slabs (nothing replaced them) with the same slot count."""
        return (self._held[0] is None and self._held[1] is None and self._key_slab is not None
                and self._lengths[0] == self._lengths[1])


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
