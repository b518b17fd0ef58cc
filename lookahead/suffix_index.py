"""The hash-chain suffix index shared by prompt lookup (one text) and the suffix cache (an arena of documents).

An index maps every `m`-gram of a token array (by a hash of its tokens) to a chain of the positions where it
ends: `head[bucket]` is the latest position, `prev[p]` the previous position in the same bucket (-1 ends the
chain). Positions are added in increasing order, so a chain runs from the most recent occurrence backwards;
colliding grams are filtered by comparing tokens. A gram holding a negative token (a document separator, an
evicted slot) is not indexed. `rank_candidates` turns the occurrences a search found into ranked draft
continuations. All kernels are pure numba functions of these arrays.
"""

import numba
import numpy as np

_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio (Fibonacci hashing)


def table_bits(capacity: int) -> int:
    """Hash-table bits giving at least `2 * capacity` buckets (load factor <= 1/2)."""
    return (2 * capacity - 1).bit_length()


@numba.njit(cache=True)
def gram_bucket(tokens, p, m, shift):
    """Bucket of the `m`-gram ending at `p` (the top `64 - shift` bits of a multiplicative hash), or -1 if the
    gram starts before the array or holds a negative token."""
    if p - m + 1 < 0:
        return -1
    h = np.uint64(0)
    for j in range(m):
        token = tokens[p - j]
        if token < 0:
            return -1
        h = (h ^ np.uint64(token)) * _HASH_MUL
        h = h ^ (h >> np.uint64(29))
    return np.int64((h * _HASH_MUL) >> shift)


@numba.njit(cache=True)
def index_range(tokens, start, stop, m, bits, head, prev):
    """Link the positions `p in [start, stop)` that end an indexable `m`-gram into the chains, in order (the
    others get `prev[p] = -1`)."""
    shift = np.uint64(64 - bits)
    for p in range(start, stop):
        b = gram_bucket(tokens, p, m, shift)
        if b < 0:
            prev[p] = -1
            continue
        prev[p] = head[b]
        head[b] = p


@numba.njit(cache=True)
def append_new_candidate(tokens, first, n, out, out_len, count):
    """Write `tokens[first:first+n]` as candidate `count` of `out` / `out_len` unless it equals, or is a
    prefix of, one of the `count` candidates already there; return whether it was written."""
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
def rank_candidates(tokens, end, occ_pos, occ_len, n_occ, k_hi, k_lo, out, out_len, out_first, out_match):
    """Pass 2 of a suffix-match search: the continuations of the `n_occ` occurrences (`occ_pos` ends of a
    match of length `occ_len`, newest first), longest match first (`k_hi` down to `k_lo`), then newest.

    A continuation is `tokens[p + 1:]` cut at `out`'s width, at `end` or at a negative token (a document
    separator); one equal to or a prefix of a kept candidate is skipped. Writes `out[:c], out_len[:c]`, the
    first token's position `out_first[:c]` and the match length `out_match[:c]`; returns `c`.
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
