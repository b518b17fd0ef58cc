"""Prompt lookup: draft the continuation of earlier occurrences of the text's current suffix.

The text is prompt + committed output, extended as tokens are committed. An index maps every
``min_ngram``-gram of the text (by a hash of its tokens) to a chain of the positions where it ends:
``head[bucket]`` is the latest position, ``prev[p]`` the previous position in the same bucket (-1 ends the
chain). Positions are added in increasing order, so a chain runs from the most recent occurrence backwards,
and the chain starting at ``prev[L-1]`` visits every earlier position whose ``min_ngram``-gram hashes like
the text's current one (colliding grams are filtered by comparing tokens).

The numba kernels below are pure functions of these arrays; the class only validates input and owns them.
"""

import numba
import numpy as np

_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio (Fibonacci hashing)


@numba.njit(cache=True)
def _mix(h, token):
    """Return the uint64 hash state ``h`` updated with one token."""
    h = (h ^ np.uint64(token)) * _HASH_MUL
    return h ^ (h >> np.uint64(29))


@numba.njit(cache=True)
def _index_range(tokens, start, stop, m, bits, head, prev):
    """Link positions ``p in [start, stop)`` that end a full ``m``-gram into the chains, in order.

    The bucket of a gram is the top ``bits`` bits of its hash (the well-mixed ones of a multiplicative hash).
    """
    shift = np.uint64(64 - bits)
    for p in range(max(start, m - 1), stop):
        h = np.uint64(0)
        for j in range(m):
            h = _mix(h, tokens[p - j])
        b = np.int64((h * _HASH_MUL) >> shift)
        prev[p] = head[b]
        head[b] = p


@numba.njit(cache=True)
def append_new_candidate(tokens, first, n, out, out_len, count):
    """Write ``tokens[first:first+n]`` as candidate ``count`` of ``out`` / ``out_len`` unless it equals, or is a
    prefix of, one of the ``count`` candidates already there; return whether it was written."""
    for c in range(count):
        if out_len[c] >= n:
            same = True
            for t in range(n):
                if out[c, t] != tokens[first + t]:
                    same = False
                    break
            if same:
                return False
    for t in range(n):
        out[count, t] = tokens[first + t]
    out_len[count] = n
    return True


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


@numba.njit(cache=True)
def rank_candidates(tokens, end, occ_pos, occ_len, n_occ, k_hi, k_lo, out, out_len, out_first, out_match):
    """Pass 2 of a suffix-match search: the continuations of the ``n_occ`` occurrences (``occ_pos`` ends of a
    match of length ``occ_len``, newest first), longest match first (``k_hi`` down to ``k_lo``), then newest.

    A continuation is ``tokens[p + 1:]`` cut at ``out``'s width, at ``end`` or at a negative token (a document
    separator); one equal to or a prefix of a kept candidate is skipped. Writes ``out[:c], out_len[:c]``, the
    first token's position ``out_first[:c]`` and the match length ``out_match[:c]``; returns ``c``.
    """
    max_candidates, max_len = out.shape
    count = 0
    for k in range(k_hi, k_lo - 1, -1):
        for i in range(n_occ):
            if occ_len[i] != k:
                continue
            first = occ_pos[i] + 1
            n = 0
            while n < max_len and first + n < end and tokens[first + n] >= 0:
                n += 1
            if not append_new_candidate(tokens, first, n, out, out_len, count):
                continue
            out_first[count], out_match[count] = first, k
            count += 1
            if count == max_candidates:
                return count
    return count


def _check_int(name: str, value: object, low: int) -> int:
    """Return ``value`` as an int; raise ValueError naming ``name`` unless it is an int ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def _table_bits(capacity: int) -> int:
    """Hash-table bits giving at least ``2 * capacity`` buckets (load factor <= 1/2)."""
    return (2 * capacity - 1).bit_length()


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
        self.min_ngram = _check_int("min_ngram", min_ngram, 1)
        self.max_ngram = _check_int("max_ngram", max_ngram, self.min_ngram)
        self._length = 0
        self._allocate(_check_int("capacity", capacity, 1))
        # Warm up (compile, or load from the on-disk cache) on the empty text: no state changes.
        self._index(0, 0)
        _search(self._tokens, 0, self.min_ngram, self.max_ngram, self._prev, self._occ_pos,
                self._occ_len, np.zeros((1, 1), dtype=np.int64), np.zeros(1, dtype=np.int64),
                np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))
        self.last_match_lengths = np.zeros(0, dtype=np.int64)  # [c] match length of each last proposal

    def _allocate(self, capacity: int) -> None:
        """(Re)allocate buffers for ``capacity`` tokens, keep the text and rebuild the index over it."""
        tokens = np.zeros(capacity, dtype=np.int64)
        if self._length:
            tokens[: self._length] = self._tokens[: self._length]
        self._tokens = tokens  # [capacity]; text is tokens[:length]
        self._bits = _table_bits(capacity)
        self._head = np.full(1 << self._bits, -1, dtype=np.int32)  # [2**bits] latest position per bucket
        self._prev = np.full(capacity, -1, dtype=np.int32)  # [capacity] previous position in the bucket
        self._occ_pos = np.zeros(capacity, dtype=np.int32)  # [capacity] search scratch
        self._occ_len = np.zeros(capacity, dtype=np.int32)  # [capacity] search scratch
        self._index(0, self._length)

    def _index(self, start: int, stop: int) -> None:
        _index_range(self._tokens, start, stop, self.min_ngram, self._bits, self._head, self._prev)

    def extend(self, tokens: np.ndarray | list[int]) -> None:
        """Append committed tokens (``[T]`` integer, any ``T >= 0``) to the text and index them.

        Raises ValueError naming ``tokens`` if it is not 1-D, not integer, or holds a negative id.
        """
        raw = np.asarray(tokens)
        if raw.ndim != 1 or (raw.size > 0 and raw.dtype.kind not in "iu"):
            raise ValueError(f"tokens must be a 1-D integer sequence, got {raw.dtype} of shape {raw.shape}")
        if raw.size == 0:
            return
        arr = raw.astype(np.int64, copy=False)  # ids beyond int64 wrap negative and are rejected below
        if arr.min() < 0:
            raise ValueError(f"tokens must be token ids in [0, 2**63), got [{raw.min()}, {raw.max()}]")
        start, stop = self._length, self._length + arr.shape[0]
        if stop > self._tokens.shape[0]:
            capacity = self._tokens.shape[0]
            while capacity < stop:
                capacity *= 2
            self._allocate(capacity)
        self._tokens[start:stop] = arr
        self._length = stop
        self._index(start, stop)

    def propose(self, max_candidates: int, max_len: int) -> list[np.ndarray]:
        """Return up to ``max_candidates`` draft continuations of the text, each a ``[1..max_len]`` int64
        array (rows of a buffer allocated for this call, never aliasing the drafter's state).

        Ranking: qualifying occurrences (see the class docstring) by match length, longest first, then by
        end position, most recent first. Walking that order, a candidate is skipped if it equals or is a
        prefix of a candidate already returned; the walk stops after ``max_candidates`` are returned. So
        the best occurrence's candidate is always first, and ``[]`` means no occurrence qualifies.
        Afterwards ``last_match_lengths`` ([c] int64) holds each returned candidate's match length.
        Raises ValueError naming ``max_candidates`` (< 0) or ``max_len`` (< 1).
        """
        max_candidates = _check_int("max_candidates", max_candidates, 0)
        max_len = _check_int("max_len", max_len, 1)
        out = np.empty((max_candidates, max_len), dtype=np.int64)  # [max_candidates, max_len]
        out_len = np.empty(max_candidates, dtype=np.int64)  # [max_candidates]
        out_first = np.empty(max_candidates, dtype=np.int64)  # [max_candidates] (unused here)
        out_match = np.empty(max_candidates, dtype=np.int64)  # [max_candidates]
        count = _search(self._tokens, self._length, self.min_ngram, self.max_ngram, self._prev,
                        self._occ_pos, self._occ_len, out, out_len, out_first, out_match)
        self.last_match_lengths = out_match[:count].copy()
        return [out[i, :n] for i, n in enumerate(out_len[:count].tolist())]

    def __len__(self) -> int:
        """Number of tokens in the text."""
        return self._length
