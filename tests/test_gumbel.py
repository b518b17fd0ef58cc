"""Counter-based Gumbel noise: SplitMix64 as published, one key per (seed, index), noise of any token subset equal
to the whole vocabulary's, the Gumbel law (the sampling tests check the seeded draws it drives)."""

from __future__ import annotations

import numpy as np
from scipy import stats

from lookahead.gumbel import gumbel_of, index_key, noise_of, noise_of_vocab, splitmix64, uniform_of


def test_splitmix64_gives_the_reference_sequence():
    # SplitMix64 seeded with 0 outputs these (Vigna's splitmix64.c: state += golden gamma, then the finaliser)
    assert splitmix64(np.uint64(0)) == 0xE220A8397B1DCDAF
    assert splitmix64(np.uint64(0x9E3779B97F4A7C15)) == 0x6E789E6AA1B965F4


def test_index_keys_are_distinct_per_seed_and_index():
    keys = {int(index_key(seed, index)) for seed in range(20) for index in range(200)}
    assert len(keys) == 20 * 200
    assert index_key(2**64 - 1, 0) != index_key(0, 0)


def test_noise_of_tokens_is_the_vocabulary_noise_at_those_tokens():
    vocab = noise_of_vocab(3, 41, 5000)
    tokens = np.array([4999, 0, 17, 17, 2500], dtype=np.int64)
    assert np.array_equal(noise_of(3, 41, tokens), vocab[tokens])
    assert np.array_equal(vocab[:3], [gumbel_of(index_key(3, 41), t) for t in range(3)])


def test_noise_is_standard_gumbel_and_finite():
    noise = np.concatenate([noise_of_vocab(11, index, 4000) for index in range(5)])
    assert np.isfinite(noise).all()
    assert stats.kstest(noise, stats.gumbel_r.cdf).pvalue > 1e-3
    assert abs(noise.mean() - np.euler_gamma) < 0.03


def test_the_extreme_hashes_give_uniforms_strictly_inside_the_unit_interval():
    for h in (0, 1, 2**12 - 1, 2**63, 2**64 - 1):
        u = uniform_of(np.uint64(h))
        assert 0.0 < u < 1.0 and np.isfinite(-np.log(-np.log(u))), h
