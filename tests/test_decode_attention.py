"""A decoding step's attention on the compiled kernel (`decode_attention.py`), on vectors of 16 floats (AVX-512) and
of 8 (AVX2): the softmax attention to
float32 rounding, scores summed in the documented order, and each query's output the same bits whatever the other
queries of the call, the number of keys its mask hides after its own, or what the hidden keys hold; where it is
used (`fused_layer.attention_loops`)."""

from __future__ import annotations

import numpy as np
import pytest

from lookahead import attention_kernel, decode_attention, fused_layer, streamed_gemm
from lookahead.compiled_ir import host_features

needs_kernel = pytest.mark.skipif(
    "+avx512f" not in host_features().split(",") or not streamed_gemm.available(),
    reason="the kernel is written for AVX-512 (and needs the streamed kernels' conditions)")
LANES = [16, 8]  # both widths: the 8-float kernel runs on AVX-512 CPUs too (tests only; there it is not chosen)


def _width(lanes: int) -> int:
    """`lanes`, or skip the test where this width's kernel does not run."""
    if not decode_attention.available(lanes):
        pytest.skip(f"the {lanes}-float kernel needs {'AVX-512' if lanes == 16 else 'AVX2 and FMA'}")
    return lanes
LOW = np.finfo(np.float32).min  # what transformers' masks hold where a key is hidden
HEAD_SIZES = [16, 32, 64, 128]
COUNTS = [1, 15, 16, 17, 37, 100]


def _inputs(queries: int, count: int, size: int, seed: int):
    generator = np.random.default_rng(seed)
    q = generator.standard_normal((queries, size), dtype=np.float32)
    keys, values = (generator.standard_normal((count, size), dtype=np.float32) * 2 for _ in range(2))
    return q, keys, values


def _reference(queries, keys, values, mask, scale):
    scores = queries.astype(np.float64) @ keys.T.astype(np.float64) * scale
    if mask is not None:
        scores = scores + mask
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True) @ values.astype(np.float64)


def _fma(a, b, c):
    """float32 fused multiply-add (a·b exact in float64, one rounding there, then to float32: equal to one rounding
    for these inputs; a mismatch would fail the equality test, not pass it)."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def _documented_score(query: np.ndarray, key: np.ndarray, scale: np.float32, width: int) -> np.float32:
    """A key's score as the module documents it: per lane of `width`, a multiply-add chain over the head's vectors,
    then the lanes added pairwise (neighbours first), then × scale."""
    lanes = (query[:width] * key[:width]).astype(np.float32)
    for v in range(1, query.shape[0] // width):
        lanes = _fma(query[width * v:width * (v + 1)], key[width * v:width * (v + 1)], lanes)
    while lanes.shape[0] > 1:
        lanes = (lanes[0::2] + lanes[1::2]).astype(np.float32)
    return np.float32(lanes[0] * scale)


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("size", HEAD_SIZES)
@pytest.mark.parametrize("count", COUNTS)
def test_attention_matches_float64_with_and_without_a_mask(lanes, size, count):
    _width(lanes)
    queries, keys, values = _inputs(11, count, size, seed=size + count)
    mask = np.zeros((11, count), np.float32)
    hidden = np.random.default_rng(count).random((11, count)) < 0.3
    hidden[:, 0] = False  # every query sees a key
    mask[hidden] = LOW
    for m in (None, mask):
        got = decode_attention.attend_queries(queries, keys, values, m, 0.25, lanes)
        np.testing.assert_allclose(got, _reference(queries, keys, values, m, 0.25), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("size", [16, 64])
@pytest.mark.parametrize("count", [7, 15, 16, 37])
def test_scores_are_the_documented_sums(lanes, size, count):
    """The scores the kernel leaves in its scratch are the documented sums bit for bit, for keys in whole blocks
    and past them."""
    _width(lanes)
    queries, keys, _ = _inputs(1, count, size, seed=3)
    scale = np.float32(0.125)
    documented = np.array([_documented_score(queries[0], key, scale, lanes) for key in keys])
    assert np.array_equal(_scores(queries, keys, scale, lanes), documented)


def _scores(queries: np.ndarray, keys: np.ndarray, scale, lanes: int) -> np.ndarray:
    """The kernel's scores of one query over `keys`: its module with the softmax and the values cut off."""
    import ctypes

    from lookahead.compiled_ir import compiled_address

    size = queries.shape[1]
    cut = ("  br i1 %t_more, label %tq_start, label %soft", "  br i1 %t_more, label %tq_start, label %exit")
    full = decode_attention.module_ir(size, lanes)
    assert cut[0] in full  # the scores' last branch, into the softmax
    ir = full.replace(*cut)
    function = ctypes.CFUNCTYPE(None, *([ctypes.c_int64] * 8), ctypes.c_float)(
        compiled_address(ir, "attend_queries", f"test-decode-scores-{size}-{lanes}"))
    count = keys.shape[0]
    scratch = np.full(decode_attention.scratch_floats(1, count), np.nan, np.float32)
    pointers = np.array([queries[0].ctypes.data, 0, 0], np.int64)
    function(pointers[0:].ctypes.data, pointers[1:].ctypes.data, pointers[2:].ctypes.data, 1, keys.ctypes.data,
             keys.ctypes.data, count, scratch.ctypes.data, scale)
    return scratch[:count]


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("size", [16, 64, 128])
def test_a_querys_output_does_not_depend_on_the_other_queries_of_the_call(lanes, size):
    _width(lanes)
    queries, keys, values = _inputs(13, 41, size, seed=5)
    together = decode_attention.attend_queries(queries, keys, values, None, 0.3, lanes)
    for first, end in ((0, 1), (2, 5), (5, 13), (12, 13)):  # other group sizes and positions in a pass
        alone = decode_attention.attend_queries(np.ascontiguousarray(queries[first:end]), keys, values, None, 0.3,
                                                lanes)
        assert np.array_equal(alone, together[first:end])


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("size", [16, 64])
@pytest.mark.parametrize("seen,count", [(1, 4), (13, 19), (16, 17), (30, 33), (31, 48)])
def test_keys_a_mask_hides_after_the_seen_ones_change_nothing(lanes, size, seen, count):
    """A row of a step of several rows attends over more slots than in a step of one, the extra ones hidden by its
    mask: the output is the same bits as over the keys it sees alone, whatever the hidden keys hold."""
    _width(lanes)
    queries, keys, values = _inputs(3, count, size, seed=seen)
    alone = decode_attention.attend_queries(queries, np.ascontiguousarray(keys[:seen]),
                                            np.ascontiguousarray(values[:seen]), None, 0.25, lanes)
    mask = np.zeros((3, count), np.float32)
    mask[:, seen:] = LOW
    values[seen:] = 1e30  # weighed at all, they would swamp the output
    keys[seen:] = 50.0
    longer = decode_attention.attend_queries(queries, keys, values, mask, 0.25, lanes)
    assert np.array_equal(longer, alone)


def test_the_widths_and_head_sizes_taken_and_refused():
    assert decode_attention.host_lanes() in (0, 8, 16)
    assert decode_attention.supports(64) and decode_attention.supports(24, 8)
    assert not decode_attention.supports(24) and not decode_attention.supports(0)
    assert not decode_attention.supports(64, 4)
    assert not decode_attention.available(4)
    with pytest.raises(ValueError, match="multiple of 16"):
        decode_attention.address(24)
    assert [decode_attention.group_size(64, lanes) for lanes in (16, 8)] == [6, 1]  # 32 / 16 vector registers


@needs_kernel
def test_the_self_check_passes_on_avx512():
    assert decode_attention.host_lanes() == 16 and decode_attention.available(16) and decode_attention.available(8)


@needs_kernel
def test_the_fused_attention_takes_the_kernel_for_the_cpus_width(monkeypatch):
    assert fused_layer.attention_loops(64).tolist() == [decode_attention.address(64, 16)]
    old = list(attention_kernel.attention_addresses(64))
    assert fused_layer.attention_loops(24).tolist() == list(attention_kernel.attention_addresses(24))
    assert fused_layer.attention_loops(12).shape == (0,)  # numba's loops
    monkeypatch.setattr(decode_attention, "host_lanes", lambda: 8)  # an AVX2 CPU
    assert fused_layer.attention_loops(64).tolist() == [decode_attention.address(64, 8)]
    assert fused_layer.attention_loops(24).tolist() == [decode_attention.address(24, 8)]
    monkeypatch.setattr(fused_layer, "GROUPED", False)
    assert fused_layer.attention_loops(64).tolist() == old
    monkeypatch.setattr(fused_layer, "GROUPED", True)
    monkeypatch.setattr(decode_attention, "available", lambda lanes: False)
    assert fused_layer.attention_loops(64).tolist() == old
