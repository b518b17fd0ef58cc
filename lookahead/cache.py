"""The only code touching KV-cache internals (with the layer class of `cache_layer.py`): keep the prefix plus the
accepted rows of a step (per sequence of a batch), drop the rest; drop finished sequences from a batch; how many
cached tokens a new text shares (`common_prefix`)."""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import (Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer,
                                      get_layer_types_and_kwargs)

from .cache_layer import SlabLayer
from .compat import CACHE_KWARG


def make_compactable(cache: Cache, config, max_slots: int, batch_size: int = 1) -> None:
    """Make `cache` (the one `generate` prepared for a model with config `config`) one whose rows lookahead can
    drop in place, or raise `ValueError`.

    Every layer must keep all its slots, so that slot indices and compaction are the same in every layer: a
    `DynamicCache`'s growing layers, and its sliding-window layers (which evict what leaves the window), are
    replaced, in place, by `SlabLayer`s (growing layers that append into preallocated storage) holding the same
    states, and the window is applied by the step's attention masks instead
    (`layout.SlidingWindow`); sliding layers cost full-length memory then. Chunked-attention layers stay, exact
    only while the generation (at most `max_slots` slots, verification rows included) fits in one chunk, at batch
    size 1. Static, quantized and offloaded caches, and a cache whose sliding layers already evicted, are refused.
    """
    if not isinstance(cache, DynamicCache):
        raise ValueError(f"lookahead needs a DynamicCache, got {type(cache).__name__}; "
                         f"remove cache_implementation= / {CACHE_KWARG}= from the generate call")
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    for i, layer in enumerate(cache.layers):
        kind = layer_types[i] if i < len(layer_types) else "full_attention"
        if type(layer) is DynamicSlidingWindowLayer and kind == "sliding_attention":
            cache.layers[i] = _growing_copy(layer)
        elif type(layer) is DynamicSlidingWindowLayer:
            _check_chunk(layer.sliding_window, max_slots, batch_size)
        elif type(layer) is DynamicLayer:
            cache.layers[i] = SlabLayer.holding(layer)
        elif type(layer) is not SlabLayer:
            raise ValueError(f"lookahead cannot compact cache layers of type {type(layer).__name__}; "
                             "use plain model.generate for this model")


def _growing_copy(layer: DynamicSlidingWindowLayer) -> SlabLayer:
    """A growing layer holding the states of `layer`, which must not have evicted any yet."""
    if layer.is_initialized and layer.get_seq_length() != layer.keys.shape[-2]:
        raise ValueError(f"the cache holds a sliding-window layer that has dropped tokens (it saw "
                         f"{layer.get_seq_length()}, keeps {layer.keys.shape[-2]}); lookahead needs every token "
                         "cached: pass DynamicCache() (no config) or no cache")
    return SlabLayer.holding(layer)


def _check_chunk(chunk: int, max_slots: int, batch_size: int) -> None:
    """Chunked-attention layers are exact only while nothing leaves the first chunk."""
    if batch_size > 1:
        raise ValueError("lookahead supports chunked attention only with batch size 1 (batched sequences leave "
                         "hole slots that count against the chunk); generate one prompt at a time")
    if max_slots > chunk - 1:
        raise ValueError(f"this model uses chunked attention (chunk {chunk}); lookahead supports it only while the "
                         f"whole generation fits in one chunk, but this one may need {max_slots} cache slots "
                         f"(prompt + new tokens + verification rows): lower max_new_tokens or tree_budget, "
                         "or use plain model.generate")


def keep_rows(cache: Cache, prefix_len: int, rows: list[int]) -> None:
    """After a step's forward, keep slots `[0, prefix_len)` plus the step rows `rows` (in that order).

    rows: indices into the step's T new rows (e.g. [0, 3, 4] = root and two accepted nodes), the same for every
    sequence of a batch. One in-place gather of the step slots per layer (the prefix is not copied); when `rows`
    is `0..k-1` the cache is cropped instead (no copy).
    """
    if rows == list(range(len(rows))):
        surplus = cache.get_seq_length() - prefix_len - len(rows)
        if surplus:
            cache.crop(-surplus)  # transformers' crop takes the number of slots to drop, negated
        return
    batch = cache.layers[0].keys.shape[0]
    _gather_step_slots(cache, prefix_len, torch.tensor([rows] * batch, dtype=torch.long))


def keep_rows_batched(cache: Cache, prefix_len: int, rows: list[list[int]]) -> int:
    """Batch form of `keep_rows`: sequence b keeps its step rows `rows[b]` at slots `prefix_len + i`.

    All sequences share one slot count, so each gets K = max len(rows[b]) new slots; a sequence with fewer kept
    rows gets K - len(rows[b]) hole slots after them, which the caller must hide from attention. Returns K.
    """
    slots = max(len(r) for r in rows)
    if all(r == list(range(len(r))) for r in rows):  # every sequence's kept rows are already in place: crop
        keep_rows(cache, prefix_len, list(range(slots)))
        return slots
    _gather_step_slots(cache, prefix_len, torch.tensor([r + [0] * (slots - len(r)) for r in rows], dtype=torch.long))
    return slots


def _gather_step_slots(cache: Cache, prefix_len: int, index: torch.Tensor) -> None:
    """In every layer, sequence b keeps the step slots `prefix_len + index[b]` (index: [B, K]) after its prefix."""
    for layer in cache.layers:  # layers may live on different devices (offloading, pipeline splits)
        layer.keys = _gather_tail(layer.keys, prefix_len, index)
        layer.values = _gather_tail(layer.values, prefix_len, index)
        _sync_length(layer)


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
    """A chunked-attention layer counts the tokens it has seen; after a gather that is its slot count (it never
    left its first chunk: `make_compactable`)."""
    if isinstance(layer, DynamicSlidingWindowLayer):
        layer.cumulative_length = layer.keys.shape[-2]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many first tokens the 1-D id arrays `a` and `b` share (a cache of `a` holds that much of `b`)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
