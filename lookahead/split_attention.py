"""A decoding step's attention over a long cache: the keys in chunks of CHUNK slots, split between the threads.

`fused_kernels.attend_grouped` shares out (row, query head) tasks key head by key head, and a thread reads the
keys and values of every key head it has a task of: the default model's 3 key heads on 2 threads make each thread
read 2 heads (the middle one's queries split between them), 4 heads read for 3. A one-row step over a long cache
reads its keys and values at the memory's pace (46 KB a cached token on the default model, float32), so its
attention took ~2x one head's time where 1.5x would do. Here the slots after the hidden lead
(`fused_kernels.hidden_lead`) are cut into chunks of CHUNK slots counted from the lead, each (key head, chunk) one
call of `decode_attention`'s kernel for all the queries of that head over that chunk's keys; the threads share the
calls by their keys (contiguous shares, ~equal slots each); the kernel prefetches the keys ahead and the values.
Each call leaves a query's output normalised over its chunk, its inverse sum and its largest score; the outputs
are joined per query in chunk order in float64: weights exp(topᶜ − top) / inverseᶜ, the output
Σ weightᶜ · outᶜ / Σ weightᶜ, rounded once to float32.

The chunks' bounds depend only on the lead and the slot count, never on the rows or threads, so a row's output is
the same bits in a step of one row and of many (its mask hides the later slots: within a chunk they weigh exactly
0, and a chunk it does not see at all weighs exactly 0 in the join: skipped) and on any number of threads (tested).
It differs from one call over all keys in the last bits (float32 rounding of the float64 attention, tested). Used
where the slots after the lead are more than CHUNK (`applies`); shorter caches keep one call per key head.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from .decode_attention import call_attend_queries, scratch_floats, sums_at

CHUNK = 256  # slots a call reads: 128 KB of one key head's keys and values at heads of 64 floats (in the core's L2)


@numba.njit(nogil=True, cache=True)
def applies(count: int) -> bool:
    """Whether a step over `count` slots (after the hidden lead) runs on the chunks: more than one chunk."""
    return count > CHUNK


@numba.njit(parallel=True, nogil=True, cache=True)
def attend_chunked(queries, keys, values, lead, length, mask, scale, threads, function,
                   out):  # pragma: no cover - compiled
    """`fused_kernels.attend_grouped`'s attention (same arguments: queries [rows, query heads, D], keys / values
    [key heads, slots, D], the additive mask [rows, slots] or [0, 0]) over slots lead…length - 1 in chunks of
    CHUNK slots counted from the lead, the (key head, chunk) calls shared by the threads, then joined."""
    rows, query_heads, head_dim = queries.shape
    heads = keys.shape[0]
    count = length - lead
    chunks = (count + CHUNK - 1) // CHUNK
    outs = np.empty((chunks, rows, query_heads, head_dim), np.float32)
    tops = np.empty((chunks, rows, query_heads), np.float32)
    inverses = np.empty((chunks, rows, query_heads), np.float32)
    parts = max(1, min(threads, heads * chunks))
    for part in numba.prange(parts):
        first, end = _share(part, parts, heads, chunks, count)
        _attend_calls(queries, keys, values, lead, length, mask, scale, function, first, end, chunks, outs, tops,
                      inverses)
    _join(outs, tops, inverses, threads, out)


@numba.njit(nogil=True, cache=True)
def _share(part, parts, heads, chunks, count):  # pragma: no cover - compiled
    """The calls (key head · chunks + chunk) first…end - 1 of share `part`: a call belongs to the share its middle
    slot falls in when all calls' slots are laid end to end and cut into `parts` equal shares (contiguous)."""
    total = heads * count
    first, end, read = 0, 0, 0
    for unit in range(heads * chunks):
        chunk = unit % chunks
        size = min(count, (chunk + 1) * CHUNK) - chunk * CHUNK
        owner = min(parts - 1, (2 * read + size) * parts // (2 * total))
        if owner < part:
            first = unit + 1
        if owner <= part:
            end = unit + 1
        read += size
    return first, max(first, end)


@numba.njit(nogil=True, cache=True)
def _attend_calls(queries, keys, values, lead, length, mask, scale, function, first, end, chunks, outs, tops,
                  inverses):  # pragma: no cover - compiled
    """Calls first…end - 1: each one key head's queries over one chunk; outputs, largest scores and inverse sums
    into outs / tops / inverses at the chunk."""
    rows, query_heads, head_dim = queries.shape
    group = query_heads // keys.shape[0]
    n = rows * group
    scratch = np.empty(scratch_floats(n, CHUNK), np.float32)
    pointers = np.zeros((3, n), np.int64)
    for unit in range(first, end):
        kv, chunk = unit // chunks, unit % chunks
        start = lead + chunk * CHUNK
        size = min(length, start + CHUNK) - start
        for member in range(n):
            t, head = member // group, kv * group + member % group
            pointers[0, member] = queries[t, head].ctypes.data
            if mask.shape[0]:
                pointers[1, member] = mask[t, start:].ctypes.data
            pointers[2, member] = outs[chunk, t, head].ctypes.data
        call_attend_queries(function, pointers[0].ctypes.data, pointers[1].ctypes.data, pointers[2].ctypes.data, n,
                            keys[kv][start:].ctypes.data, values[kv][start:].ctypes.data, size,
                            scratch.ctypes.data, scale)
        at = sums_at(n, size)
        for member in range(n):
            t, head = member // group, kv * group + member % group
            inverses[chunk, t, head] = scratch[at + member]
            tops[chunk, t, head] = scratch[at + n + member]


@numba.njit(parallel=True, nogil=True, cache=True)
def _join(outs, tops, inverses, threads, out):  # pragma: no cover - compiled
    """out[t, h] = Σ weightᶜ · outs[c, t, h] / Σ weightᶜ in float64, weightᶜ = exp(topᶜ − top) / inverseᶜ; a chunk
    of weight 0 (every key it holds hidden from the row) is skipped."""
    chunks, rows, query_heads, head_dim = outs.shape
    tasks = rows * query_heads
    parts = max(1, min(threads, tasks))
    for part in numba.prange(parts):
        total = np.empty(head_dim, np.float64)
        for task in range(part * tasks // parts, (part + 1) * tasks // parts):
            t, head = task // query_heads, task % query_heads
            top = tops[0, t, head]
            for chunk in range(1, chunks):
                top = max(top, tops[chunk, t, head])
            total[:] = 0.0
            weights = 0.0
            for chunk in range(chunks):
                weight = math.exp(np.float64(tops[chunk, t, head]) - top) / np.float64(inverses[chunk, t, head])
                if weight > 0.0:
                    weights += weight
                    for i in range(head_dim):
                        total[i] += weight * outs[chunk, t, head, i]
            for i in range(head_dim):
                out[t, head, i] = np.float32(total[i] / weights)
