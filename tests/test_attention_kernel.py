"""The compiled attention loops (`attention_kernel.py`): one query's scores and one weighted sum of values, in the
summation order the module documents (emulated here with float64 arithmetic rounded as the kernel rounds), each
key's score the same bits wherever its slot falls, and keys of weight 0 adding nothing."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from lookahead import attention_kernel, streamed_gemm

pytestmark = pytest.mark.skipif(not streamed_gemm.available(), reason="needs the compiled kernels (a CPU with FMA)")

HEAD_SIZES = [8, 16, 64, 128]
COUNTS = [1, 7, 8, 9, 37]
_DOTS = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float)
_WEIGHTED = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)


def _dots(query: np.ndarray, keys: np.ndarray, count: int, scale: float) -> np.ndarray:
    out = np.full(count, np.nan, np.float32)
    function = _DOTS(attention_kernel.attention_addresses(query.shape[0])[0])
    function(query.ctypes.data, keys.ctypes.data, count, out.ctypes.data, scale)
    return out


def _weighted(weights: np.ndarray, values: np.ndarray, count: int) -> np.ndarray:
    out = np.full(values.shape[1], np.nan, np.float32)
    function = _WEIGHTED(attention_kernel.attention_addresses(values.shape[1])[1])
    function(weights.ctypes.data, values.ctypes.data, count, out.ctypes.data)
    return out


def _fma(a, b, c):
    """float32 fused multiply-add: a·b is exact in float64 and a·b + c rounds once more there, then to float32
    (equal to one rounding for these inputs; a mismatch would fail the equality tests below, not pass them)."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def _inputs(head_dim: int, count: int, seed: int):
    generator = np.random.default_rng(seed)
    query = generator.standard_normal(head_dim, dtype=np.float32)
    keys = generator.standard_normal((count, head_dim), dtype=np.float32)
    return query, keys


def _documented_score(query: np.ndarray, key: np.ndarray, scale: np.float32) -> np.float32:
    lanes = (query[:8] * key[:8]).astype(np.float32)  # one rounded product per lane
    for v in range(1, query.shape[0] // 8):
        lanes = _fma(query[8 * v:8 * v + 8], key[8 * v:8 * v + 8], lanes)
    pairs = [np.float32(lanes[i] + lanes[i + 1]) for i in range(0, 8, 2)]
    return np.float32(np.float32(np.float32(pairs[0] + pairs[1]) + np.float32(pairs[2] + pairs[3])) * scale)


@pytest.mark.parametrize("head_dim", HEAD_SIZES)
@pytest.mark.parametrize("count", COUNTS)
def test_scores_are_the_documented_sums_and_match_float64(head_dim, count):
    query, keys = _inputs(head_dim, count, seed=head_dim + count)
    got = _dots(query, keys, count, 0.125)
    expected = np.array([_documented_score(query, key, np.float32(0.125)) for key in keys])
    assert np.array_equal(got, expected)
    np.testing.assert_allclose(got, keys.astype(np.float64) @ query.astype(np.float64) * 0.125, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("head_dim", HEAD_SIZES)
def test_a_keys_score_does_not_depend_on_its_slot_or_the_count(head_dim):
    query, keys = _inputs(head_dim, 29, seed=1)
    whole = _dots(query, keys, 29, 0.3)
    for shift in (1, 3, 8):  # the same keys in other slots: blocks of 8 and the tail split them differently
        shifted = np.ascontiguousarray(keys[shift:])
        assert np.array_equal(_dots(query, shifted, 29 - shift, 0.3), whole[shift:])
    assert np.array_equal(_dots(query, keys, 11, 0.3), whole[:11])


def _documented_weighted(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    head_dim = values.shape[1]
    chains = max(1, 8 // (head_dim // 8))
    sets = [np.zeros(head_dim, np.float32) for _ in range(chains)]
    for s, weight in enumerate(weights):
        sets[s % chains] = _fma(np.full(head_dim, weight, np.float32), values[s], sets[s % chains])
    total = sets[0]
    for other in sets[1:]:
        total = (total + other).astype(np.float32)
    return total


@pytest.mark.parametrize("head_dim", HEAD_SIZES)
@pytest.mark.parametrize("count", COUNTS)
def test_weighted_values_are_the_documented_sums_and_match_float64(head_dim, count):
    generator = np.random.default_rng(head_dim * count)
    weights = generator.random(count, dtype=np.float32)
    values = generator.standard_normal((count, head_dim), dtype=np.float32)
    got = _weighted(weights, values, count)
    assert np.array_equal(got, _documented_weighted(weights, values))
    np.testing.assert_allclose(got, weights.astype(np.float64) @ values.astype(np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", HEAD_SIZES)
def test_keys_of_weight_zero_add_nothing(head_dim):
    generator = np.random.default_rng(7)
    weights = generator.random(23, dtype=np.float32)
    values = generator.standard_normal((23, head_dim), dtype=np.float32)
    first = _weighted(weights, values, 13)
    weights[13:] = 0.0  # a longer step whose extra keys its mask hides
    assert np.array_equal(_weighted(weights, values, 23), first)


def test_heads_not_made_of_whole_vectors_are_refused():
    assert attention_kernel.supports(64) and not attention_kernel.supports(12) and not attention_kernel.supports(0)
    with pytest.raises(ValueError, match="multiple of 8"):
        attention_kernel.attention_addresses(12)

