"""A step's attention over a long cache in chunks of keys shared by the threads (`split_attention.py`): the
softmax attention to float32 rounding, the same bits on any number of threads, for a row in a step of one row and
of many (across the switch from one call per key head to chunks and across a chunk's end), for a padded batch entry
and without its padding; the calls shared out whole and evenly; greedy generation over long prompts through it
identical to plain greedy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import fused_test_model

from lookahead import Lookahead, LookaheadConfig, decode_attention, fused_kernels, fused_layer, hf, split_attention
from lookahead.row_kernels import RowKernels

CHUNK = split_attention.CHUNK
LOW = np.finfo(np.float32).min
SCALE = np.float32(0.25)


def _kernel(lanes: int) -> np.ndarray:
    """`attend_after`'s kernels argument for heads of 16 floats on `lanes`-float vectors (skip where it can't run)."""
    if not decode_attention.available(lanes):
        pytest.skip(f"decode_attention's {lanes}-float kernel does not run on this CPU")
    return np.array([decode_attention.address(16, lanes)], np.int64)


def _inputs(rows: int, length: int, seed: int = 0):
    """Queries [rows, 6 heads, 16], keys and values [2 key heads, length + 5 slots, 16], a zero mask [rows, length]."""
    generator = np.random.default_rng(seed)
    queries = generator.standard_normal((rows, 6, 16), dtype=np.float32)
    keys, values = (generator.standard_normal((2, length + 5, 16), dtype=np.float32) * 2 for _ in range(2))
    return queries, keys, values, np.zeros((rows, length), np.float32)


def _reference(queries, keys, values, mask, length):
    """float64 attention over the first `length` slots (query heads 3h…3h + 2 read key head h)."""
    k, v = (np.repeat(x[:, :length].astype(np.float64), 3, axis=0) for x in (keys, values))
    scores = np.einsum("rhd,hsd->rhs", queries.astype(np.float64), k) * float(SCALE) + mask[:, None, :]
    weights = np.exp(scores - scores.max(axis=2, keepdims=True))
    return np.einsum("rhs,hsd->rhd", weights / weights.sum(axis=2, keepdims=True), v)


def _attend(queries, keys, values, length, mask, kernel, threads=2, lead=0):
    out = np.empty(queries.shape, np.float32)
    fused_kernels.attend_after(queries, keys, values, lead, length, mask, SCALE, threads, kernel, out)
    return out


@pytest.mark.parametrize("lanes", [16, 8])
@pytest.mark.parametrize("rows,length", [(1, CHUNK + 1), (3, 2 * CHUNK + 40), (7, 3 * CHUNK)])
def test_chunked_attention_matches_float64(lanes, rows, length):
    queries, keys, values, mask = _inputs(rows, length, seed=length)
    hidden = np.random.default_rng(rows).random(mask.shape) < 0.2
    hidden[:, -1] = False  # every row sees a key
    mask[hidden] = LOW
    for m in (mask, np.zeros((0, 0), np.float32)):
        got = _attend(queries, keys, values, length, m, _kernel(lanes))
        reference = _reference(queries, keys, values, m if m.shape[0] else np.zeros_like(mask), length)
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("lanes", [16, 8])
def test_the_same_bits_on_any_number_of_threads(lanes):
    queries, keys, values, mask = _inputs(5, 3 * CHUNK + 17, seed=2)
    one = _attend(queries, keys, values, 3 * CHUNK + 17, mask, _kernel(lanes), threads=1)
    for threads in (2, 3, 4, 7):
        assert np.array_equal(_attend(queries, keys, values, 3 * CHUNK + 17, mask, _kernel(lanes), threads), one)


@pytest.mark.parametrize("lanes", [16, 8])
@pytest.mark.parametrize("seen,rows", [(CHUNK - 3, 9), (CHUNK, 2), (2 * CHUNK - 1, 4), (2 * CHUNK + 30, 12)])
def test_a_row_attends_alike_in_a_step_of_one_row_and_of_many(lanes, seen, rows):
    """A step's first row sees `seen` slots; the step's other rows add slots its mask hides — past the switch from
    one call per key head to chunks, past a chunk's end, or filling a whole chunk it does not see — which hold
    huge values here (weighed at all, they would swamp the output). Its output is the same bits as alone."""
    queries, keys, values, _ = _inputs(rows, seen + rows, seed=seen)
    alone = _attend(queries[:1].copy(), keys, values, seen, np.zeros((1, seen), np.float32), _kernel(lanes))
    mask = np.zeros((rows, seen + rows), np.float32)
    mask[0, seen:] = LOW
    values[:, seen:] = 1e30
    keys[:, seen:] = 40.0
    together = _attend(queries, keys, values, seen + rows, mask, _kernel(lanes))
    assert np.array_equal(together[0], alone[0])
    hidden_chunk = np.zeros((1, seen + CHUNK), np.float32)  # a chunk of nothing but hidden slots weighs nothing
    hidden_chunk[0, seen:] = LOW
    longer_keys, longer_values = (np.concatenate([x[:, :seen], np.full((2, CHUNK, 16), 7.0, np.float32)], axis=1)
                                  for x in (keys, values))
    longer = _attend(queries[:1].copy(), longer_keys, longer_values, seen + CHUNK, hidden_chunk, _kernel(lanes))
    assert np.array_equal(longer, alone)


@pytest.mark.parametrize("lanes", [16, 8])
@pytest.mark.parametrize("padding", [1, 37, CHUNK + 5])
def test_a_padded_entry_attends_as_it_does_without_its_padding(lanes, padding):
    """Chunks are counted from the hidden lead, so a left-padded entry's chunks are its unpadded self's, bit for
    bit; the padding (NaN here) is never read."""
    cached = 2 * CHUNK + 11
    queries, keys, values, mask = _inputs(3, padding + cached, seed=padding)
    mask[:, :padding] = LOW
    keys[:, :padding], values[:, :padding] = np.nan, np.nan
    padded = _attend(queries, keys, values, padding + cached, mask, _kernel(lanes), lead=padding)
    trimmed = _attend(queries, np.ascontiguousarray(keys[:, padding:]), np.ascontiguousarray(values[:, padding:]),
                      cached, np.ascontiguousarray(mask[:, padding:]), _kernel(lanes))
    assert np.array_equal(padded, trimmed) and not np.isnan(padded).any()


def test_chunks_apply_past_one_chunk_only():
    assert not split_attention.applies(CHUNK) and split_attention.applies(CHUNK + 1)


@pytest.mark.parametrize("heads,count", [(3, CHUNK + 1), (3, 1000), (2, 5 * CHUNK), (1, 300), (8, 4 * CHUNK + 9)])
@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_shares_cover_every_call_once_and_evenly(heads, count, parts):
    chunks = -(-count // CHUNK)
    sizes = [min(count, (c + 1) * CHUNK) - c * CHUNK for _ in range(heads) for c in range(chunks)]
    shares = [split_attention._share(part, parts, heads, chunks, count) for part in range(parts)]
    assert shares[0][0] == 0 and shares[-1][1] == heads * chunks
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:])) and all(f <= e for f, e in shares)
    loads = [sum(sizes[f:e]) for f, e in shares]
    assert max(loads) <= heads * count / parts + CHUNK


@pytest.mark.parametrize("lanes", [16, 8])
def test_the_kernel_leaves_each_querys_inverse_sum_and_largest_score(lanes):
    import ctypes

    generator = np.random.default_rng(4)
    queries = generator.standard_normal((3, 16), dtype=np.float32)
    keys, values = (generator.standard_normal((45, 16), dtype=np.float32) for _ in range(2))
    mask = np.zeros((3, 45), np.float32)
    mask[1, 7] = -3.0
    mask[2, :20] = LOW
    scratch = np.full(decode_attention.scratch_floats(3, 45), np.nan, np.float32)
    out = np.empty((3, 16), np.float32)
    pointers = np.array([[q.ctypes.data for q in queries], [m.ctypes.data for m in mask],
                         [o.ctypes.data for o in out]], np.int64)
    _kernel(lanes)
    function = ctypes.CFUNCTYPE(None, *([ctypes.c_int64] * 8), ctypes.c_float)(decode_attention.address(16, lanes))
    function(pointers[0].ctypes.data, pointers[1].ctypes.data, pointers[2].ctypes.data, 3, keys.ctypes.data,
             values.ctypes.data, 45, scratch.ctypes.data, SCALE)
    scores = queries.astype(np.float64) @ keys.T.astype(np.float64) * float(SCALE) + mask
    at = decode_attention.sums_at(3, 45)
    np.testing.assert_allclose(scratch[at + 3:at + 6], scores.max(axis=1), rtol=1e-6)
    sums = np.exp(scores - scores.max(axis=1, keepdims=True)).sum(axis=1)
    np.testing.assert_allclose(scratch[at:at + 3], 1 / sums, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama-heads16", "qwen2-heads16"])
@pytest.mark.parametrize("config", [LookaheadConfig(), LookaheadConfig.off()], ids=["speculate", "off"])
@pytest.mark.parametrize("lanes", [16, 8])
def test_greedy_over_long_prompts_is_plain_greedy(name, config, lanes, monkeypatch):
    """Prompts longer than a chunk and their continuations through the fused layers on the kernel of either width
    (every step over more than a chunk of slots, so on the chunks): identical to plain greedy."""
    _kernel(lanes)
    monkeypatch.setattr(fused_layer, "GROUPED", True)
    monkeypatch.setattr(decode_attention, "host_lanes", lambda: lanes)
    monkeypatch.setattr(hf, "row_kernels_for", lambda model, refresh=False, quiet=False: RowKernels(0, 64))
    chosen, real = [], fused_layer.attention_loops
    monkeypatch.setattr(fused_layer, "attention_loops", lambda head_dim: chosen.append(real(head_dim)) or chosen[-1])
    model = fused_test_model(name, 5)
    for seed, length in ((0, CHUNK + 20), (1, 2 * CHUNK + 70)):
        generator = torch.Generator().manual_seed(seed)
        head = torch.randint(0, 64, (1, length // 2), generator=generator)
        prompt = torch.cat([head, head[:, :length - length // 2]], dim=1)
        plain = model.generate(prompt, do_sample=False, max_new_tokens=30)
        fast = model.generate(prompt, do_sample=False, max_new_tokens=30, custom_generate=Lookahead(config))
        assert torch.equal(plain, fast)
    assert chosen and {len(loops) for loops in chosen} == {1}  # the kernel's address: `attend_grouped`
