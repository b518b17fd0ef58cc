"""The keys and values of the server's latest texts, reused by a request that starts the same way as one of them.

An editor sends the whole file up to the cursor on every keystroke pause and a chat client the whole conversation
on every turn, so a request usually repeats most of an earlier one, and the prefill is most of its time: ~0.9 s
for a 1 300-token file of the default model on the Zen 5 machine, against ~0.3 s for 64 new tokens after it.
`PromptCache` keeps what each generation left in its KV cache (the keys and values of the prompt and of the tokens
it committed, in order) and gives the next generation the one that shares the longest start with its prompt,
cut to that start; `generate` then forwards only the rest of the prompt (transformers' own way of continuing from
a cache, which `hf.py` honours: `_uncached_length`). A text that shares most of a kept one takes that cache over
(the generation grows it in place); one that shares less than half of it (a conversation that shares only the
system prompt with another, a file opened after its neighbour) gets a copy of the shared start and the kept cache
stays. The least recently used texts go first when the caches' storage would pass `max_bytes`.

The tokens do not change: the reused slots hold the numbers the earlier forward computed for the same tokens at
the same positions. The new tail is forwarded in one pass of fewer rows than a fresh prefill would take, so its
keys, values and logits can differ from a fresh prefill's in the last bits, as those of lookahead's other
kernels do from plain `generate`'s; tests compare the tokens with plain greedy decoding. The server's single
worker thread is its only user; a lock guards it anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from .cache import common_prefix
from .cache_layer import SlabLayer


@dataclass
class _Text:
    """A kept text: its token ids, the cache holding their keys and values, the cache's storage in bytes."""

    ids: np.ndarray
    cache: DynamicCache
    size: int


class PromptCache:
    """The KV caches of earlier texts (see the module docstring), at most `max_bytes` of storage."""

    def __init__(self, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self._texts: list[_Text] = []  # the most recently used first
        self._lock = threading.Lock()

    def take(self, input_ids: Sequence[int], config) -> tuple[DynamicCache, int]:
        """A cache to generate from `input_ids` with and how many of its first tokens it already holds: the kept
        text sharing the longest start with `input_ids` (all but the last token at most: the prompt's last
        position must be forwarded for its logits), its cache cut to that start — handed over when the start is
        at least half of it (nothing kept for that text until `keep`), else a copy of the start — or a fresh
        `DynamicCache` for the model of `config` (its layers made up front, as `generate` makes them, so lookahead
        can make them `SlabLayer`s) and 0."""
        ids = np.asarray(input_ids, dtype=np.int64)
        with self._lock:
            shared, later = max(((min(common_prefix(t.ids, ids), len(ids) - 1), -i) for i, t in enumerate(self._texts)),
                                default=(0, 0))  # a tie goes to the most recently used text
            if shared <= 0:
                return DynamicCache(config=config), 0
            best = -later
            text = self._texts[best]
            if 2 * shared < len(text.ids) and all(type(layer) is SlabLayer for layer in text.cache.layers):
                return _start_copy(text.cache, shared, config), shared
            del self._texts[best]
        text.cache.crop(shared - text.cache.get_seq_length())
        return text.cache, shared

    def keep(self, sequence: Sequence[int], cache: DynamicCache) -> bool:
        """Keep `cache`, what a generation of `sequence` (prompt + output token ids, batch size 1) left, for a
        later `take` (kept texts that `sequence` starts with go: it holds them all); returns whether it was kept.
        Not kept: a cache holding more slots than `sequence` has tokens or more than one sequence (not what a
        generation of it leaves), or larger than `max_bytes`. The least recently used texts go while the kept
        storage passes `max_bytes`."""
        length = cache.get_seq_length()
        size = storage_bytes(cache)
        if length == 0 or length > len(sequence) or cache.layers[0].keys.shape[0] != 1 or size > self.max_bytes:
            return False
        ids = np.asarray(sequence[:length], dtype=np.int64)
        with self._lock:
            self._texts = [t for t in self._texts if common_prefix(t.ids, ids) < len(t.ids)]
            self._texts.insert(0, _Text(ids, cache, size))
            while sum(t.size for t in self._texts) > self.max_bytes:
                self._texts.pop()
        return True

    def info(self) -> dict:
        """What is kept: {"texts": how many, "tokens": their cached tokens, "bytes": their storage, "max_bytes":
        the bound}."""
        with self._lock:
            return {"texts": len(self._texts), "tokens": sum(len(t.ids) for t in self._texts),
                    "bytes": sum(t.size for t in self._texts), "max_bytes": self.max_bytes}


def storage_bytes(cache: DynamicCache) -> int:
    """Bytes of the storage behind `cache`'s keys and values (a slab's whole capacity, each storage once)."""
    seen: dict[int, int] = {}
    for layer in cache.layers:
        for states in (layer.keys, layer.values):
            if isinstance(states, torch.Tensor):
                storage = states.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _start_copy(cache: DynamicCache, length: int, config) -> DynamicCache:
    """A cache for the model of `config` holding a copy of the first `length` slots of `cache`'s `SlabLayer`s."""
    copy = DynamicCache(config=config)
    copy.layers = [SlabLayer.of(layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone())
                   for layer in cache.layers]
    return copy
