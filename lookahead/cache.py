"""The only code touching KV-cache internals: keep the prefix plus the accepted rows of a step, drop the rest."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


def check_compactable(cache: Cache) -> None:
    """Raise `ValueError` unless `cache` is a `DynamicCache` whose layers all grow without limit.

    Static, quantized, offloaded and sliding-window caches cannot drop arbitrary rows in place.
    """
    if not isinstance(cache, DynamicCache):
        raise ValueError(f"lookahead needs a DynamicCache, got {type(cache).__name__}; "
                         "remove cache_implementation= / past_key_values= from the generate call")
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise ValueError(f"lookahead cannot compact cache layers of type {type(layer).__name__} "
                             "(e.g. sliding-window attention); use plain model.generate for this model")


def keep_rows(cache: Cache, prefix_len: int, rows: list[int]) -> None:
    """After a step's forward, keep slots `[0, prefix_len)` plus the step rows `rows` (in that order).

    rows: indices into the step's T new rows (e.g. [0, 3, 4] = root and two accepted nodes). One gather per
    layer; when `rows` is `0..k-1` the cache is cropped instead (no copy).
    """
    if rows == list(range(len(rows))):
        surplus = cache.get_seq_length() - prefix_len - len(rows)
        if surplus:
            cache.crop(-surplus)  # transformers' crop takes the number of slots to drop, negated
        return
    keep = torch.cat([torch.arange(prefix_len), prefix_len + torch.tensor(rows, dtype=torch.long)])
    for layer in cache.layers:  # layers may live on different devices (offloading, pipeline splits)
        index = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)
