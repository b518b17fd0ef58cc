"""Prompt lookup: draft the continuation of earlier occurrences of the text's current suffix.

The text is prompt + committed output, extended as tokens are committed, indexed by its ``min_ngram``-grams
with the hash-chain index of `suffix_index.py`: the chain starting at ``prev[L-1]`` visits every earlier
position whose ``min_ngram``-gram hashes like the text's current one.

The numba kernel below is a pure function of these arrays; the class only validates input and owns them.
"""

from dataclasses import dataclass

import numba
import numpy as np

from .checks import as_token_ids, check_int
from .suffix_index import index_range, rank_candidates, table_bits

@numba.njit(cache=True)
def _search(tokens, length, min_n, max_n, prev, occ_pos, occ_len, out, out_len, out_first, out_match):
    """Fill ``out[:c], out_len[:c], out_match[:c]`` with the ranked candidates and their match lengths (see
    ``PromptLookup.propose``); return ``c``.

    ``out``: ``[max_candidates, max_len]``; ``occ_pos / occ_len`` are scratch of at least ``length``;
    ``out_first``: scratch of ``max_candidates``.
    """
    if out.shape[0] == 0 or length < min_n + 1:
        return 0  # no suffix of min_n tokens with a position before it
    last = length - 1
    # Pass 1: every earlier end position p with its match length, most recent first.
    n_occ = 0
    p = prev[last]
    while p >= 0:
        k = 0
        while k < max_n and k <= p and tokens[p - k] == tokens[last - k]:
            k += 1
        if k >= min_n:
            occ_pos[n_occ] = p
            occ_len[n_occ] = k
            n_occ += 1
        p = prev[p]
    return rank_candidates(tokens, length, occ_pos, occ_len, n_occ, max_n, min_n, out, out_len, out_first, out_match)


@dataclass(frozen=True)
class Matches:
    """What `PromptLookup.propose` found: the candidates (`paths`, each a [1..max_len] int64 array) and the
    match length of each (`match_lengths`: [c] int64)."""

    paths: list[np.ndarray]
    match_lengths: np.ndarray


class PromptLookup:
    """Incremental prompt-lookup drafter over the committed text (prompt + output).

    ``propose`` ranks earlier occurrences of the text's suffix. With ``L = len(self)`` and ``T`` the text,
    an *occurrence* is an end position ``p`` with ``0 <= p <= L-2``; its *match length* ``k(p)`` is the
    largest ``k <= max_ngram`` with ``T[p-j] == T[L-1-j]`` for all ``0 <= j < k`` (so ``k <= p+1``).
    Occurrences with ``k(p) >= min_ngram`` qualify; each gives the candidate
    ``T[p+1 : min(p+1+max_len, L)]`` (1 to ``max_len`` tokens, never past the end of the text).

    Buffers start at ``capacity`` tokens and double whenever the text outgrows them (the index is rebuilt
    then, amortized O(1) per token). Raises ValueError naming the field if ``min_ngram < 1``,
    ``max_ngram < min_ngram`` or ``capacity < 1``.
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, capacity: int = 4096) -> None:
        self.min_ngram = check_int("min_ngram", min_ngram, 1)
        self.max_ngram = check_int("max_ngram", max_ngram, self.min_ngram)
        self._length = 0
        self._allocate(check_int("capacity", capacity, 1))
        # Warm up (compile, or load from the on-disk cache) on the empty text: no state changes.
        self._index(0, 0)
        _search(self._tokens, 0, self.min_ngram, self.max_ngram, self._prev, self._occ_pos,
                self._occ_len, np.zeros((1, 1), dtype=np.int64), np.zeros(1, dtype=np.int64),
                np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))

    def _allocate(self, capacity: int) -> None:
        """(Re)allocate buffers for ``capacity`` tokens, keep the text and rebuild the index over it."""
        tokens = np.zeros(capacity, dtype=np.int64)
        if self._length:
            tokens[: self._length] = self._tokens[: self._length]
        self._tokens = tokens  # [capacity]; text is tokens[:length]
        self._bits = table_bits(capacity)
        self._head = np.full(1 << self._bits, -1, dtype=np.int32)  # [2**bits] latest position per bucket
        self._prev = np.full(capacity, -1, dtype=np.int32)  # [capacity] previous position in the bucket
        self._occ_pos = np.zeros(capacity, dtype=np.int32)  # [capacity] search scratch
        self._occ_len = np.zeros(capacity, dtype=np.int32)  # [capacity] search scratch
        self._index(0, self._length)

    def _index(self, start: int, stop: int) -> None:
        index_range(self._tokens, start, stop, self.min_ngram, self._bits, self._head, self._prev)

    def extend(self, tokens: np.ndarray | list[int]) -> None:
        """Append committed tokens (``[T]`` integer, any ``T >= 0``) to the text and index them.

        Raises ValueError naming ``tokens`` if it is not 1-D, not integer, or holds a negative id.
        """
        arr = as_token_ids("tokens", tokens)
        if arr.size == 0:
            return
        start, stop = self._length, self._length + arr.shape[0]
        if stop > self._tokens.shape[0]:
            capacity = self._tokens.shape[0]
            while capacity < stop:
                capacity *= 2
            self._allocate(capacity)
        self._tokens[start:stop] = arr
        self._length = stop
        self._index(start, stop)

    def propose(self, max_candidates: int, max_len: int) -> Matches:
        """Return up to ``max_candidates`` draft continuations of the text, each a ``[1..max_len]`` int64
        array (rows of a buffer allocated for this call, never aliasing the drafter's state), with their match
        lengths.

        Ranking: qualifying occurrences (see the class docstring) by match length, longest first, then by
        end position, most recent first. Walking that order, a candidate is skipped if it equals or is a
        prefix of a candidate already returned; the walk stops after ``max_candidates`` are returned. So
        the best occurrence's candidate is always first, and empty ``paths`` mean no occurrence qualifies.
        Raises ValueError naming ``max_candidates`` (< 0) or ``max_len`` (< 1).
        """
        max_candidates = check_int("max_candidates", max_candidates, 0)
        max_len = check_int("max_len", max_len, 1)
        out = np.empty((max_candidates, max_len), dtype=np.int64)  # [max_candidates, max_len]
        out_len = np.empty(max_candidates, dtype=np.int64)  # [max_candidates]
        out_first = np.empty(max_candidates, dtype=np.int64)  # [max_candidates] (unused here)
        out_match = np.empty(max_candidates, dtype=np.int64)  # [max_candidates]
        count = _search(self._tokens, self._length, self.min_ngram, self.max_ngram, self._prev,
                        self._occ_pos, self._occ_len, out, out_len, out_first, out_match)
        return Matches([out[i, :n] for i, n in enumerate(out_len[:count].tolist())], out_match[:count])

    def __len__(self) -> int:
        """Number of tokens in the text."""
        return self._length
