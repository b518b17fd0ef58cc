"""Counter-based Gumbel noise for seeded sampling: g(seed, index, token) computed for just the tokens asked.

The seeded rule emits at sequence index t the token argmax(log p + g_t) (`sampling.sample_seeded`). Its noise is a
hash, not a stream: g_t(token) = -log(-log(u)) with u in (0, 1) made from SplitMix64 of (the index key, the token),
where the index key is SplitMix64(SplitMix64(seed) XOR t). So the walk scores only the tokens with mass (~170 of
49k after top-p) and a draft orders only the children it proposes, instead of drawing the whole vocabulary's noise
for every index (~0.6 ms each). Numba functions of uint64 keys; `index_key` makes a key from (seed, index).
"""

from __future__ import annotations

import numba
import numpy as np

@numba.njit(cache=True)
def splitmix64(x):
    """SplitMix64's step and finaliser on a uint64 (wrapping arithmetic): a bijection of 64-bit integers with good
    avalanche; splitmix64(0) is the generator's first output from state 0."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def index_key(seed: int, index: int) -> np.uint64:
    """The noise key of sequence index `index` under `seed` (both in [0, 2**64)): for a fixed seed a bijection of
    the index, so indices never share noise."""
    return np.uint64(splitmix64(np.uint64(splitmix64(np.uint64(seed))) ^ np.uint64(index)))  # numba returns ints


@numba.njit(cache=True)
def uniform_of(h):
    """A uniform in (0, 1) from a 64-bit hash `h` (uint64): (its top 52 bits + 1/2) / 2**52, exact in float64 and
    strictly inside (0, 1) for every h, so both logs of the Gumbel transform stay finite (with 53 bits the top
    value would round up to 1.0 and give +inf noise)."""
    return (np.float64(h >> np.uint64(12)) + 0.5) * 2.220446049250313e-16


@numba.njit(cache=True)
def gumbel_of(key, token):
    """Standard Gumbel noise (float64) of `token` (int64 >= 0) under the index key `key` (uint64)."""
    return -np.log(-np.log(uniform_of(splitmix64(key ^ splitmix64(np.uint64(token))))))


@numba.njit(cache=True)
def gumbel_of_tokens(key, tokens, out):
    """out[i] = gumbel_of(key, tokens[i]) for tokens [n] int64, out [n] float64."""
    for i in range(tokens.shape[0]):
        out[i] = gumbel_of(key, tokens[i])


def noise_of(seed: int, index: int, tokens: np.ndarray) -> np.ndarray:
    """Gumbel noise [n] float64 of `tokens` ([n] int64) at sequence index `index` under `seed`."""
    out = np.empty(tokens.shape[0], dtype=np.float64)
    gumbel_of_tokens(index_key(seed, index), np.ascontiguousarray(tokens, dtype=np.int64), out)
    return out


def noise_of_vocab(seed: int, index: int, vocab: int) -> np.ndarray:
    """Gumbel noise [vocab] float64 of every token at sequence index `index` under `seed`."""
    return noise_of(seed, index, np.arange(vocab, dtype=np.int64))  # the same compiled loop: the same numbers
