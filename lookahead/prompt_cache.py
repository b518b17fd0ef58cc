"""The keys and values of the server's latest text, reused by the next request that starts the same way.

An editor sends the whole file up to the cursor on every keystroke pause and a chat client the whole conversation
on every turn, so a request usually repeats most of the one before it, and the prefill is most of its time: ~0.9 s
for a 1 300-token file of the default model on the Zen 5 machine, against ~0.2 s for 64 new tokens after it.
`PromptCache` keeps what a generation left in its KV cache (the keys and values of the prompt and of the tokens
it committed, in order) and hands it to the next generation cropped to the longest start the two texts share;
`generate` then forwards only the rest of the prompt (transformers' own way of continuing from a cache, which
`hf.py` honours: `_uncached_length`).

The tokens do not change: the reused slots hold the numbers the earlier forward computed for the same tokens at
the same positions. The new tail is forwarded in one pass of fewer rows than a fresh prefill would take, so its
keys, values and logits can differ from a fresh prefill's in the last bits, as those of lookahead's other
kernels do from plain `generate`'s; tests compare the tokens with plain greedy decoding. One cache is kept (one
text), within a byte bound; the server's single worker thread is its only user, and a lock guards it anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch
from transformers import DynamicCache


class PromptCache:
    """The KV cache of one earlier text (see the module docstring), at most `max_bytes` of storage."""

    def __init__(self, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self._ids: np.ndarray | None = None  # the tokens whose keys and values `_cache` holds, in order
        self._cache: DynamicCache | None = None
        self._lock = threading.Lock()

    def take(self, input_ids: Sequence[int], config) -> tuple[DynamicCache, int]:
        """A cache to generate from `input_ids` with and how many of its first tokens it already holds: the kept
        cache cropped to the longest start it shares with `input_ids` (all but the last token at most: the
        prompt's last position must be forwarded for its logits), or a fresh `DynamicCache` for the model of
        `config` (its layers made up front, as `generate` makes them, so lookahead can make them `SlabLayer`s) and
        0. The kept cache is handed over (the generation grows it in place): nothing is kept until the next
        `keep`."""
        with self._lock:
            ids, cache, self._ids, self._cache = self._ids, self._cache, None, None
        shared = 0
        if cache is not None and len(input_ids) > 1:
            shared = min(common_prefix(ids, np.asarray(input_ids, dtype=np.int64)), len(input_ids) - 1)
        if shared == 0:
            return DynamicCache(config=config), 0
        cache.crop(shared - cache.get_seq_length())
        return cache, shared

    def keep(self, sequence: Sequence[int], cache: DynamicCache) -> bool:
        """Keep `cache`, what a generation of `sequence` (prompt + output token ids, batch size 1) left, for the
        next `take`; returns whether it was kept. Not kept: a cache holding more slots than `sequence` has tokens
        or more than one sequence (not what a generation of it leaves), or larger than `max_bytes`."""
        length = cache.get_seq_length()
        if length == 0 or length > len(sequence) or _batch_size(cache) != 1 or storage_bytes(cache) > self.max_bytes:
            return False
        with self._lock:
            self._ids, self._cache = np.asarray(sequence[:length], dtype=np.int64), cache
        return True

    def info(self) -> dict:
        """What is kept: {"tokens": cached tokens, "bytes": their storage, "max_bytes": the bound}."""
        with self._lock:
            cache = self._cache
            return {"tokens": 0 if cache is None else cache.get_seq_length(),
                    "bytes": 0 if cache is None else storage_bytes(cache), "max_bytes": self.max_bytes}


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many first tokens the id arrays `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def storage_bytes(cache: DynamicCache) -> int:
    """Bytes of the storage behind `cache`'s keys and values (a slab's whole capacity, each storage once)."""
    seen: dict[int, int] = {}
    for layer in cache.layers:
        for states in (layer.keys, layer.values):
            if isinstance(states, torch.Tensor):
                storage = states.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _batch_size(cache: DynamicCache) -> int:
    """The number of sequences `cache` holds (its first initialized layer's)."""
    for layer in cache.layers:
        if isinstance(layer.keys, torch.Tensor):
            return layer.keys.shape[0]
    return 0
