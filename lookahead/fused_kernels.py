"""Compiled (numba) kernels of one Llama-style decoder layer step: norms, RoPE, the KV-cache append, attention,
SiLU gating and residuals around the four streamed-kernel products, in one call per layer (`decoder_layer`) or
one call for all the layers of a step (`decoder_stack`).

`decoder_layer` computes, for the rows of one step, what `lean_layers.LeanForward` computes with
~40 dispatched PyTorch operations per layer (each costing microseconds between weight streams that evict the
interpreter's working set): the same formulas in the same order per element, the products on the same
`streamed_gemm` kernel (so they are bit-identical), the reductions in their own order (the RMS norm's sum of
squares, the attention's dot products, softmax sum and weighted values), so the layer's output differs from the
PyTorch path in the last bits, as the streamed kernel's products differ from PyTorch's matmul.

The attention computes each (row, query head) on its own, over the keys its mask row lets it see, the masked
keys weighing exactly 0: `exp` is Cephes' single-precision polynomial with the power of two built from its
exponent bits (a loop the compiler vectorises; within 1.02 ulp of the exact value over [-87, 0], measured against
float64), and exactly 0 below e⁻⁸⁷. The whole attention of the queries sharing a key head runs in one call of
`decode_attention`'s kernel for heads of whole vectors of the CPU's width (16 floats with AVX-512, 8 with AVX2;
`attend_grouped`); otherwise the scores and the weighted sum of values run on `attention_kernel`'s compiled loops
when the head size is a multiple of 8 floats (numba's `_scores` / `_weighted_values` otherwise).
"""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.extending import intrinsic

from . import split_attention
from .attention_kernel import call_dots, call_weighted
from .decode_attention import call_attend_queries, scratch_floats
from .streamed_gemm import _launch, product_scratch
from .vector_ir import EXP_FLOOR, EXP_LN2, EXP_POLYNOMIAL, LOG2E  # noqa: F401 — `_exp_below`'s formula

_REDUCE = {"reassoc", "nsz", "contract"}  # reductions: vectorised sums (their own order, deterministic)
HIDDEN = np.float32(-1e30)  # a mask value at or below this hides its slot (masks use float32's lowest, -3.4e38)


@numba.njit(nogil=True, cache=True)
def rms_norm(x, weight, eps, width, out):  # pragma: no cover - compiled
    """out[r] = (x[r] · 1/√(Σ x[r]² / width + eps)) · weight, for every row r of x [rows, hidden]."""
    rows, hidden = x.shape
    for r in range(rows):
        total = np.float32(0.0)
        for i in range(hidden):
            total += x[r, i] * x[r, i]
        inverse = np.float32(1.0) / np.sqrt(total / width + eps)
        for i in range(hidden):
            out[r, i] = (x[r, i] * inverse) * weight[i]


@numba.njit(nogil=True, cache=True)
def product(kernel, transpose, threads, width, x, xt, panels, bias, y):  # pragma: no cover - compiled
    """y [rows, N_pad] = x [rows, K] @ Wᵀ (+ bias on the first len(bias) columns) on the streamed kernel, through
    `streamed_gemm._launch`: `panels` the address of the weight's `[N_pad / width, K, width]` panels, `xt` scratch
    of `streamed_gemm.product_scratch(rows, K)` floats, `kernel`/`transpose` the compiled functions' addresses
    (`streamed_gemm._kernel_address`)."""
    rows, k = x.shape
    n = y.shape[1]
    blocks = n // width
    source = np.int64(x.ctypes.data)
    transposed = np.int64(xt.ctypes.data) if rows > 1 else source  # one row is its own transpose
    _launch(kernel, transpose, rows, source, transposed, panels, np.int64(y.ctypes.data), k, n, blocks,
            max(1, min(threads, blocks)))
    for r in range(rows):
        for i in range(bias.shape[0]):
            y[r, i] += bias[i]


@numba.njit(nogil=True, cache=True)
def rotate_and_store(qkv, cos, folded_sin, query_heads, key_heads, head_dim, keys, values, start, queries):
    # pragma: no cover - compiled
    """RoPE on the query and key heads of qkv [rows, (q + 2·kv heads) · D] as `lean_layers` computes it
    (x · cos + roll(x, D/2) · folded sin, two rounded products and a rounded sum): queries into `queries`
    [rows, q heads, D], keys into keys[b, :, start + t], the value heads copied into values[b, :, start + t], for
    keys/values [B, key heads, slots, D] and the rows batch entry by batch entry (row r = b · T + t, T = rows / B)."""
    rows = qkv.shape[0]
    per_entry = rows // keys.shape[0]
    half = head_dim // 2
    for r in range(rows):
        b, t = r // per_entry, r % per_entry
        for head in range(query_heads + key_heads):
            base = head * head_dim
            for i in range(head_dim):
                partner = qkv[r, base + i + half] if i < half else qkv[r, base + i - half]
                rotated = qkv[r, base + i] * cos[r, i] + partner * folded_sin[r, i]
                if head < query_heads:
                    queries[r, head, i] = rotated
                else:
                    keys[b, head - query_heads, start + t, i] = rotated
        for head in range(key_heads):
            base = (query_heads + key_heads + head) * head_dim
            for i in range(head_dim):
                values[b, head, start + t, i] = qkv[r, base + i]


@numba.njit(nogil=True, cache=True, fastmath=_REDUCE)
def _scores(query, keys, length, scale, out):  # pragma: no cover - compiled
    """out[s] = (query · keys[s]) · scale for the first `length` keys."""
    for s in range(length):
        total = np.float32(0.0)
        for i in range(query.shape[0]):
            total += query[i] * keys[s, i]
        out[s] = total * scale


@numba.njit(nogil=True, cache=True, fastmath={"contract"})
def _exp_below(scores, length, top, powers):  # pragma: no cover - compiled
    """scores[s] ← the polynomial part of exp(scores[s] - top), powers[s] ← its power of two (0 below e⁻⁸⁷); the
    product of the two is the exponential."""
    bits = powers.view(np.int32)
    for s in range(length):
        x = scores[s] - top
        kept = x >= EXP_FLOOR
        scores[s], n = exp_parts(max(x, EXP_FLOOR))
        bits[s] = ((n + np.int32(127)) << 23) if kept else np.int32(0)


@numba.njit(nogil=True, cache=True, fastmath={"contract"}, inline="always")
def exp_parts(x):  # pragma: no cover - compiled
    """(e^r, n) with e^x = e^r · 2^n for float32 x in [EXP_FLOOR, 88]: Cephes' single-precision formula
    (`vector_ir`), inlined into the loops that call it so that they vectorise."""
    n = np.floor(x * LOG2E + np.float32(0.5))
    r = x - n * EXP_LN2[0] - n * EXP_LN2[1]
    p = EXP_POLYNOMIAL[0]
    p = p * r + EXP_POLYNOMIAL[1]
    p = p * r + EXP_POLYNOMIAL[2]
    p = p * r + EXP_POLYNOMIAL[3]
    p = p * r + EXP_POLYNOMIAL[4]
    p = p * r + EXP_POLYNOMIAL[5]
    return p * r * r + r + np.float32(1.0), np.int32(n)


@numba.njit(nogil=True, cache=True, fastmath=_REDUCE)
def _weights(scores, powers, length):  # pragma: no cover - compiled
    """scores[s] ← scores[s] · powers[s] (the exponentials); returns their sum."""
    total = np.float32(0.0)
    for s in range(length):
        weight = scores[s] * powers[s]
        scores[s] = weight
        total += weight
    return total


@numba.njit(nogil=True, cache=True, fastmath={"contract"})
def _weighted_values(weights, values, length, out):  # pragma: no cover - compiled
    """out = Σ_s weights[s] · values[s], four keys at a time."""
    out[:] = 0
    s = 0
    while s + 4 <= length:
        w0, w1, w2, w3 = weights[s], weights[s + 1], weights[s + 2], weights[s + 3]
        for i in range(out.shape[0]):
            out[i] += (w0 * values[s, i] + w1 * values[s + 1, i]) + (w2 * values[s + 2, i] + w3 * values[s + 3, i])
        s += 4
    while s < length:
        for i in range(out.shape[0]):
            out[i] += weights[s] * values[s, i]
        s += 1


@numba.njit(nogil=True, cache=True)
def attend(queries, keys, values, length, mask, scale, threads, kernels, out):  # pragma: no cover - compiled
    """out[t, h] = softmax(queries[t, h] · keys[g]ᵀ · scale + mask[t]) · values[g] over the first `length` cached
    slots, g the key head of query head h (grouped-query); mask [rows, length] additive, or [0, 0]: none.
    kernels: the addresses of `attention_kernel`'s compiled `dots` and `weighted` for this head size, or empty
    (numba's loops). `attend_after` with no slot left out."""
    attend_after(queries, keys, values, 0, length, mask, scale, threads, kernels, out)


@numba.njit(nogil=True, cache=True)
def hidden_lead(mask, first, end):  # pragma: no cover - compiled
    """How many leading slots every row first…end - 1 of the additive mask [rows, slots] hides (a value at or
    below HIDDEN: `attend` weighs such a slot exactly 0 for any score below 1e29 in size), at most all slots but
    the last; 0 for the empty "none" mask."""
    if mask.shape[0] == 0:
        return 0
    lead = mask.shape[1] - 1
    for t in range(first, end):
        s = 0
        while s < lead and mask[t, s] <= HIDDEN:
            s += 1
        lead = s
    return lead


@numba.njit(nogil=True, cache=True)
def entry_leads(mask, entries):  # pragma: no cover - compiled
    """`hidden_lead` of each of `entries` batch entries, whose rows are the mask's rows one entry after the other
    (int64 [entries]; zeros for the empty "none" mask). A step's mask is every layer's, so a step computes them
    once."""
    leads = np.zeros(entries, np.int64)
    if mask.shape[0] == 0:
        return leads
    per_entry = mask.shape[0] // entries
    for b in range(entries):
        leads[b] = hidden_lead(mask, b * per_entry, (b + 1) * per_entry)
    return leads


@numba.njit(parallel=True, nogil=True, cache=True)
def attend_after(queries, keys, values, lead, length, mask, scale, threads, kernels,
                 out):  # pragma: no cover - compiled
    """`attend` over slots lead…length - 1 only: the first `lead` slots, which every row's mask hides (a left-padded
    batch entry's padding, `hidden_lead`), are not read, so an entry computes what it computes without them, bit
    for bit (its sums start at its first real slot). The (row, query head) tasks run key head by key head, so a
    thread reads one head's keys and values from its core's cache for all the rows and query heads that share
    them. kernels with one address: `decode_attention`'s kernel (`attend_grouped`)."""
    if kernels.shape[0] == 1:
        attend_grouped(queries, keys, values, lead, length, mask, scale, threads, kernels[0], out)
        return
    rows, query_heads, head_dim = queries.shape
    group = query_heads // keys.shape[0]
    tasks = rows * query_heads
    parts = max(1, min(threads, tasks))
    count = length - lead
    for part in numba.prange(parts):
        row = np.empty(count, np.float32)  # a task's scores, then its weights
        powers = np.empty(count, np.float32)
        for task in range(part * tasks // parts, (part + 1) * tasks // parts):
            kv, member = task // (rows * group), task % (rows * group)
            t, head = member // group, kv * group + member % group
            seen_keys, seen_values = keys[kv][lead:], values[kv][lead:]
            if kernels.shape[0]:
                call_dots(kernels[0], queries[t, head].ctypes.data, seen_keys.ctypes.data, count, row.ctypes.data,
                          scale)
            else:
                _scores(queries[t, head], seen_keys, count, scale, row)
            if mask.shape[0]:
                for s in range(count):
                    row[s] += mask[t, lead + s]
            top = row[0]
            for s in range(1, count):
                top = max(top, row[s])
            _exp_below(row, count, top, powers)
            inverse = np.float32(1.0) / _weights(row, powers, count)
            if kernels.shape[0]:
                call_weighted(kernels[1], row.ctypes.data, seen_values.ctypes.data, count, out[t, head].ctypes.data)
            else:
                _weighted_values(row, seen_values, count, out[t, head])
            for i in range(head_dim):
                out[t, head, i] *= inverse


@numba.njit(parallel=True, nogil=True, cache=True)
def attend_grouped(queries, keys, values, lead, length, mask, scale, threads, function,
                   out):  # pragma: no cover - compiled
    """`attend_after` on `decode_attention`'s kernel (at address `function`): the (row, query head) tasks, key head
    by key head, split into `threads` contiguous shares; each share calls the kernel once per key head it touches,
    with that head's queries, their mask rows and outputs. Over more than `split_attention.CHUNK` slots, that
    module's chunks of keys instead."""
    if split_attention.applies(length - lead):
        split_attention.attend_chunked(queries, keys, values, lead, length, mask, scale, threads, function, out)
        return
    rows, query_heads, head_dim = queries.shape
    group = query_heads // keys.shape[0]
    per_head = rows * group
    tasks = keys.shape[0] * per_head
    parts = max(1, min(threads, tasks))
    count = length - lead
    for part in numba.prange(parts):
        first, end = part * tasks // parts, (part + 1) * tasks // parts
        scratch = np.empty(scratch_floats(min(per_head, end - first), count), np.float32)
        pointers = np.zeros((3, per_head), np.int64)
        task = first
        while task < end:
            kv = task // per_head
            stop = min(end, (kv + 1) * per_head)
            for i in range(stop - task):
                member = task + i - kv * per_head
                t, head = member // group, kv * group + member % group
                pointers[0, i] = queries[t, head].ctypes.data
                if mask.shape[0]:
                    pointers[1, i] = mask[t, lead:].ctypes.data
                pointers[2, i] = out[t, head].ctypes.data
            call_attend_queries(function, pointers[0].ctypes.data, pointers[1].ctypes.data, pointers[2].ctypes.data,
                                stop - task, keys[kv][lead:].ctypes.data, values[kv][lead:].ctypes.data, count,
                                scratch.ctypes.data, scale)
            task = stop


@numba.njit(nogil=True, cache=True)
def silu_gate(gate_up, intermediate, out):  # pragma: no cover - compiled
    """out[t, i] = silu(gate[t, i]) · up[t, i], gate and up the two halves of gate_up's first 2 · intermediate
    columns; silu(g) = g / (1 + exp(-g)) as PyTorch's CPU kernel writes it."""
    for t in range(gate_up.shape[0]):
        for i in range(intermediate):
            g = gate_up[t, i]
            out[t, i] = (g / (np.float32(1.0) + np.exp(-g))) * gate_up[t, intermediate + i]


@numba.njit(nogil=True, cache=True)
def add_rows(a, b, columns, out):  # pragma: no cover - compiled
    """out[t, i] = a[t, i] + b[t, i] for the first `columns` columns."""
    for t in range(out.shape[0]):
        for i in range(columns):
            out[t, i] = a[t, i] + b[t, i]


@numba.njit(nogil=True, cache=True)
def decoder_layer(kernels, transpose, threads, dims, panels, floats, biases, norms, hidden, cos, folded_sin, keys,
                  values, start, mask, leads, attention, out):  # pragma: no cover - compiled
    """One Llama-style decoder layer for hidden [rows, size], the rows of B batch entries one entry after the other
    (keys/values [B, key heads, slots, D]; T = rows / B rows each), into out [rows, size]: the attention's inputs
    (`attention_inputs`), `attend_after` of each entry's rows over its first start + T slots with its rows of mask
    [rows, start + T] (additive, or [0, 0] for a lone row that sees every slot; `attention` its compiled loops'
    addresses, or empty) from the first slot one of them sees (leads [B], `entry_leads` of the mask: a left-padded
    entry's padding is not read), the rest of the layer (`layer_output`). The products take all the rows at once;
    every row's numbers are those it gets computed alone, without its padding."""
    rows = hidden.shape[0]
    queries = np.empty((rows, dims[0], dims[2]), np.float32)
    attention_inputs(kernels, transpose, threads, dims, panels, floats, biases, norms, hidden, cos, folded_sin, keys,
                     values, start, queries)
    attended = np.empty((rows, dims[0], dims[2]), np.float32)
    per_entry = rows // keys.shape[0]
    for b in range(keys.shape[0]):
        first, end = b * per_entry, (b + 1) * per_entry
        entry_mask = mask[first:end] if mask.shape[0] else mask
        attend_after(queries[first:end], keys[b], values[b], leads[b], start + per_entry, entry_mask, floats[3],
                     threads, attention, attended[first:end])
    layer_output(kernels, transpose, threads, dims, panels, floats, biases, norms, hidden, attended, out)


@intrinsic
def _floats_at(typingctx, address):
    """The float32 pointer at an int64 address (for `numba.carray` views of memory numba was not handed)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.float32)))

    return types.CPointer(types.float32)(types.int64), codegen


@numba.njit(nogil=True, cache=True)
def decoder_stack(kernels, transpose, threads, dims, panels, floats, biases, norms, hidden, cos, folded_sin, slabs,
                  capacities, start, mask, attention, batch):  # pragma: no cover - compiled
    """Every layer of a decoder stack, one after the other, for hidden [rows, size] (`batch` entries' rows one entry
    after the other); returns the last layer's output [rows, size]. Layer l is `decoder_layer` with kernels[l],
    panels[l] (each [layers, 4]), floats[l] ([layers, 4]), biases[l] ([layers, 4, max N]), norms[l] ([layers, 2,
    size]) and its cache's key and value slabs, contiguous float32 [batch, key heads, capacities[l], D] at the
    addresses slabs[l] ([layers, 2]; the caller keeps them alive); dims, the RoPE tables, start, mask and attention
    are every layer's."""
    leads = entry_leads(mask, batch)
    for layer in range(panels.shape[0]):
        shape = (batch, dims[1], capacities[layer], dims[2])
        keys = numba.carray(_floats_at(slabs[layer, 0]), shape)
        values = numba.carray(_floats_at(slabs[layer, 1]), shape)
        out = np.empty_like(hidden)
        decoder_layer(kernels[layer], transpose, threads, dims, panels[layer], floats[layer], biases[layer],
                      norms[layer], hidden, cos, folded_sin, keys, values, start, mask, leads, attention, out)
        hidden = out
    return hidden


@numba.njit(nogil=True, cache=True)
def attention_inputs(kernels, transpose, threads, dims, panels, floats, biases, norms, hidden, cos, folded_sin, keys,
                     values, start, queries):  # pragma: no cover - compiled
    """The input norm, the q/k/v product and RoPE of hidden [rows, size]: the rotated queries into queries
    [rows, query heads, D], the rows' keys and values into keys/values [B, key heads, ≥ start + T, D] at slots
    start…start + T - 1 of their batch entries (`rotate_and_store`: T = rows / B rows per entry).

    dims: query heads, key heads, head dim, intermediate size, panel width, then the padded output widths of the
    q/k/v, o, gate/up and down products, then their bias lengths (0: none); panels: their weights' panel addresses;
    kernels: the compiled kernel for each one's panels (`streamed_gemm._kernel_address` of its kind); floats: the
    two norms' eps, the hidden size, the attention scale; biases [4, max N]; norms [2, size]."""
    rows, size = hidden.shape
    scratch = np.empty(product_scratch(rows, size), np.float32)
    normed = np.empty((rows, size), np.float32)
    rms_norm(hidden, norms[0], floats[0], floats[2], normed)
    qkv = np.empty((rows, dims[5]), np.float32)
    product(kernels[0], transpose, threads, dims[4], normed, scratch, panels[0], biases[0, :dims[9]], qkv)
    rotate_and_store(qkv, cos, folded_sin, dims[0], dims[1], dims[2], keys, values, start, queries)


@numba.njit(nogil=True, cache=True)
def layer_output(kernels, transpose, threads, dims, panels, floats, biases, norms, hidden, attended, out):
    # pragma: no cover - compiled
    """The rest of the layer after attention (arguments as `attention_inputs`; attended [rows, query heads, D]): the
    o product plus hidden, the post-attention norm, gate/up, SiLU gating, the down product plus the residual."""
    rows, size = hidden.shape
    query_heads, head_dim, intermediate, width = dims[0], dims[2], dims[3], dims[4]
    scratch = np.empty(product_scratch(rows, max(size, intermediate, query_heads * head_dim)), np.float32)
    projected = np.empty((rows, dims[6]), np.float32)
    product(kernels[1], transpose, threads, width, attended.reshape(rows, query_heads * head_dim), scratch, panels[1],
            biases[1, :dims[10]], projected)
    residual = np.empty((rows, size), np.float32)
    add_rows(projected, hidden, size, residual)
    normed = np.empty((rows, size), np.float32)
    rms_norm(residual, norms[1], floats[1], floats[2], normed)
    gate_up = np.empty((rows, dims[7]), np.float32)
    product(kernels[2], transpose, threads, width, normed, scratch, panels[2], biases[2, :dims[11]], gate_up)
    activated = np.empty((rows, intermediate), np.float32)
    silu_gate(gate_up, intermediate, activated)
    down = np.empty((rows, dims[8]), np.float32)
    product(kernels[3], transpose, threads, width, activated, scratch, panels[3], biases[3, :dims[12]], down)
    add_rows(down, residual, size, out)
