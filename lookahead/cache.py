"""The only code touching KV-cache internals: keep the prefix plus the accepted rows of a step (per sequence of a
batch), drop the rest; drop finished sequences from a batch."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer


def check_compactable(cache: Cache, max_slots: int, batch_size: int = 1) -> None:
    """Raise `ValueError` unless lookahead can drop arbitrary rows of `cache` in place.

    That holds for a `DynamicCache` whose layers grow without limit, and for sliding-window layers while the
    generation (at most `max_slots` cached slots, verification rows included) fits inside the window, where
    sliding-window attention equals full attention. Static, quantized and offloaded caches are refused.
    """
    if not isinstance(cache, DynamicCache):
        raise ValueError(f"lookahead needs a DynamicCache, got {type(cache).__name__}; "
                         "remove cache_implementation= / past_key_values= from the generate call")
    for layer in cache.layers:
        if type(layer) is DynamicSlidingWindowLayer:
            _check_sliding_window(layer.sliding_window, max_slots, batch_size)
        elif type(layer) is not DynamicLayer:
            raise ValueError(f"lookahead cannot compact cache layers of type {type(layer).__name__}; "
                             "use plain model.generate for this model")


def _check_sliding_window(window: int, max_slots: int, batch_size: int) -> None:
    """Sliding-window layers are exact only while nothing slides out of the window."""
    if batch_size > 1:
        raise ValueError("lookahead supports sliding-window attention only with batch size 1 (batched sequences "
                         "leave hole slots that count against the window); generate one prompt at a time")
    if max_slots > window - 1:
        raise ValueError(f"this model uses sliding-window attention (window {window}); lookahead supports it only "
                         f"while the whole generation fits in the window, but this one may need {max_slots} cache "
                         f"slots (prompt + new tokens + verification rows): lower max_new_tokens or tree_budget, "
                         "or use plain model.generate")


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
        _sync_length(layer)


def keep_rows_batched(cache: Cache, prefix_len: int, rows: list[list[int]]) -> int:
    """Batch form of `keep_rows`: sequence b keeps its step rows `rows[b]` at slots `prefix_len + i`.

    All sequences share one slot count, so each gets K = max len(rows[b]) new slots; a sequence with fewer kept
    rows gets K - len(rows[b]) hole slots after them, which the caller must hide from attention. Returns K.
    """
    slots = max(len(r) for r in rows)
    if all(r == list(range(len(r))) for r in rows):  # every sequence's kept rows are already in place: crop
        keep_rows(cache, prefix_len, list(range(slots)))
        return slots
    index = torch.tensor([r + [0] * (slots - len(r)) for r in rows], dtype=torch.long)  # [B, K]
    for layer in cache.layers:
        layer.keys = _gather_tail(layer.keys, prefix_len, index)
        layer.values = _gather_tail(layer.values, prefix_len, index)
        _sync_length(layer)
    return slots


def _gather_tail(states: torch.Tensor, prefix_len: int, index: torch.Tensor) -> torch.Tensor:
    """[B, H, prefix_len + T, D] -> [B, H, prefix_len + K, D]: the prefix, then per sequence the slots
    `prefix_len + index[b]`. Only the T step slots are copied (in place); the prefix is not touched."""
    b, h, _, d = states.shape
    slots = index.shape[1]
    index = index.to(states.device)[:, None, :, None].expand(b, h, slots, d)
    states[:, :, prefix_len: prefix_len + slots] = states[:, :, prefix_len:].gather(2, index)
    return states[:, :, : prefix_len + slots]


def keep_sequences(cache: Cache, sequences: list[int]) -> None:
    """Keep only the batch entries `sequences` (e.g. drop finished sequences), in that order; an entry listed
    several times is copied (one prompt's cache for each of its `num_return_sequences` copies)."""
    for layer in cache.layers:
        index = torch.tensor(sequences, dtype=torch.long, device=layer.keys.device)
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)


def _sync_length(layer) -> None:
    """A sliding-window layer counts the tokens it has seen; after a gather that is its slot count (it never
    slid: `check_compactable`)."""
    if isinstance(layer, DynamicSlidingWindowLayer):
        layer.cumulative_length = layer.keys.shape[-2]
