"""Recycled rows per token pair: the target's top-k after a token t kept apart for each token p before it.

Token recycling (`recycle.py`) keeps one row of predicted next tokens per token id: what the target chose after
t the last time a row carrying t was verified, whatever came before t. After "of" in "one of" and in "because of"
the next token differs; a row kept per pair (p, t) tells them apart. Replayed on the suite's first 4 prompts per
category (their 96-token greedy outputs, a throw-away script, session 37), the first draft position was right
26% → 34% of the time on chat, 40% → 46% on code, 37% → 43% on rag with pair rows consulted first (the pairs
also seeded from the model's own text, `recycle_prior.py`), at the same one candidate per position.

The pair rows live in a bounded open-addressing hash table, keyed by `p * vocab + t`:

    keys   [S] int64:       the pair of each slot (-1 = empty)
    next   [S, k] int32:    its predicted next tokens, best first (-1 padded)
    scores [S, k] float32:  their stored scores (raw logits, or log counts when seeded from a prior)
    seeded [S] bool:        whether the row came from a prior rather than from a verified row (the replay above:
                            a verified pair's row was right 44-88% of the time per category, a seeded one 12-40%,
                            so drafts from the two are valued apart)

A key lives within `PROBES` slots of its hash. Writing a pair that is not stored takes the first empty slot of
that window, or else evicts the pair at the window's first slot (a verified row always finds a place; a seeded
row only takes an empty slot). Slots are never emptied except by `clear`, so a lookup stops at the first empty
slot. The kernels are pure numba functions of these arrays; `recycle.RecycleTable` owns them and its lock.
"""

from __future__ import annotations

import numba
import numpy as np

PAIR_SLOTS = 1 << 17  # slots of a table (9 MB at k = 8; the default model's prior seeds 73 k of them)
PROBES = 8  # slots a key may sit in after its hash
_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio (Fibonacci hashing)


@numba.njit(cache=True, nogil=True)
def _home(keys, key):  # pragma: no cover - compiled
    """The first slot of `key`'s window in a table of `keys.shape[0]` (a power of two) slots."""
    bits = 0
    while (1 << bits) < keys.shape[0]:
        bits += 1
    h = (np.uint64(key) * _HASH_MUL) >> np.uint64(64 - bits) if bits else np.uint64(0)
    return np.int64(h)


@numba.njit(cache=True, nogil=True)
def _probe(keys, key):  # pragma: no cover - compiled
    """(the first slot of `key`'s window holding `key` or empty, or -1 when the window is full of other keys; the
    window's first slot). Slots are never emptied, so a stored key sits before the window's first empty slot."""
    size = keys.shape[0]
    home = _home(keys, key)
    for j in range(min(PROBES, size)):
        s = (home + j) & (size - 1)
        if keys[s] == key or keys[s] < 0:
            return s, home
    return -1, home


@numba.njit(cache=True, nogil=True)
def find_pair(keys, key):  # pragma: no cover - compiled
    """The slot holding `key` (>= 0), or -1 (not stored, or the table has no slots)."""
    if keys.shape[0] == 0 or key < 0:
        return -1
    s, _ = _probe(keys, key)
    return s if s >= 0 and keys[s] == key else -1


@numba.njit(cache=True, nogil=True)
def place_pair(keys, key, evict):  # pragma: no cover - compiled
    """The slot to write `key`'s row into: its own slot, else the first empty one of its window, else (when
    `evict`) the window's first slot, whose pair is dropped; -1 when there is none. Sets `keys[slot] = key`."""
    if keys.shape[0] == 0 or key < 0:
        return -1
    s, home = _probe(keys, key)
    if s < 0:
        if not evict:
            return -1
        s = home
    keys[s] = key
    return s


@numba.njit(cache=True, nogil=True)
def seed_pairs(keys, nxt, scores, seeded, pair_keys, pair_next, pair_scores):  # pragma: no cover - compiled
    """Write the rows of `pair_keys` [m] int64 (`pair_next` [m, k'] int32, `pair_scores` [m, k'] float32, cut or
    padded to the table's k) into empty slots only; pairs already stored and full windows are left alone.
    Returns how many rows were written."""
    k = nxt.shape[1]
    written = 0
    for i in range(pair_keys.shape[0]):
        if find_pair(keys, pair_keys[i]) >= 0:
            continue
        s = place_pair(keys, pair_keys[i], False)
        if s < 0:
            continue
        for r in range(k):
            inside = r < pair_next.shape[1]
            nxt[s, r] = pair_next[i, r] if inside else -1
            scores[s, r] = pair_scores[i, r] if inside else 0.0
        seeded[s] = True
        written += 1
    return written


def empty_pairs(slots: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A table of `slots` (0, or a power of two) empty slots of width `k`: (keys, next, scores, seeded)."""
    if slots and slots & (slots - 1):
        raise ValueError(f"pair slots must be 0 or a power of two, got {slots}")
    return np.full(slots, -1, dtype=np.int64), np.full((slots, k), -1, dtype=np.int32), \
        np.zeros((slots, k), dtype=np.float32), np.zeros(slots, dtype=np.bool_)


def pair_keys(prev: np.ndarray, tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """The table keys `prev * vocab_size + tokens` ([n] int64); -1 where either token is outside the vocabulary."""
    prev, tokens = np.asarray(prev, dtype=np.int64), np.asarray(tokens, dtype=np.int64)
    inside = (prev >= 0) & (prev < vocab_size) & (tokens >= 0) & (tokens < vocab_size)
    return np.where(inside, prev * vocab_size + tokens, -1)
