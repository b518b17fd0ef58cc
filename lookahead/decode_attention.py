"""A decoding step's attention compiled for the host CPU: all the queries that share a key head at once.

`attend_after` ran each (row, query head) on its own through `attention_kernel`'s loops on vectors of 8 floats:
~2.0 ns a key for the scores (a horizontal tree per 8 keys, each key read once per query) and ~1.8 ns for the
weighted values, ~4.5 ns a (query, key) with the softmax between (one thread, 800 cached slots, the default
model's heads of 64, Zen 5). On a grounded prompt's cache that is 0.6 ms of a one-row step and 1.9 ms of a
four-row step. Here one call takes the n queries of a thread's share that read one key head, on vectors of 16
floats with AVX-512 or of 8 with AVX2 (L lanes):

- scores: key block by key block (L keys: 4 KB at heads of 64 and 16 lanes, read from memory once and from L1 for
  every other query), each query's L keys as L independent multiply-add chains over the head's vectors of L
  floats, then one tree of shuffles and adds turning the L accumulators into the block's L scores; keys past the
  last whole block one by one, through the very same tree;
- softmax, per query: the mask row added, the maximum, the weights exp(s − max) (Cephes' polynomial, the constants
  of `vector_ir`; exactly 0 below e⁻⁸⁷, so a masked key weighs nothing), their sum lane by lane (slot s into
  lane s mod L) then the L lanes in order;
- weighted values: as many queries at a time as the registers hold (`group_size`), each output element one chain
  of multiply-adds in slot order (the value vectors loaded once for the group), times the inverse of the sum;
- at each key block, the keys AHEAD_SLOTS slots on are prefetched into L1 and the block's values into L2 (a block
  is a 4 KB page at heads of 64, where the CPU's prefetcher stops); each query's inverse sum and largest score are
  left in the scratch for `split_attention`, which joins calls over chunks of a long cache.

Every score, weight, sum and output is computed in an order fixed by the width, the head size and the key's slot,
never by how many keys, queries or rows the call has (keys of weight 0 add exactly nothing): a row's attention is
the same bits in a step of one row and of many (tested). The output differs from `attention_kernel`'s and from
SDPA in the last bits, within float32 rounding of the float64 attention (tested). Used for heads of whole vectors
(`supports`) where the width's instructions run (`host_lanes`, `available`).
"""

from __future__ import annotations

import ctypes
import functools

import numba
import numpy as np
from numba import types as nb_types
from numba.extending import intrinsic

from . import streamed_gemm
from .compiled_ir import call_codegen, compiled_address, host_features
from .vector_ir import EXP_FLOOR, NEGATIVE_INFINITY, Width, chain, float_literal, pairwise, vector_declarations

WIDTHS = (16, 8)  # floats a vector: AVX-512's, AVX2's
REGISTERS = {16: 32, 8: 16}  # vector registers of each width's instruction set
MAX_GROUP = 8  # queries a pass of the weighted values takes at most
AHEAD_SLOTS = 32  # how far ahead of the key block being scored its keys are prefetched (8 KB at heads of 64)
PAD = 16  # the scratch pads each query's scores to whole vectors of the wider width (enough for both)


def host_lanes() -> int:
    """The vector width the kernel is written for on this CPU: 16 with AVX-512, 8 with AVX2 and FMA, else 0."""
    features = host_features().split(",")
    if "+avx512f" in features:
        return 16
    return 8 if "+avx2" in features and "+fma" in features else 0


def supports(head_dim: int, lanes: int = 16) -> bool:
    """Whether the kernel for vectors of `lanes` floats takes heads of this size (whole vectors)."""
    return lanes in WIDTHS and head_dim > 0 and head_dim % lanes == 0


def group_size(head_dim: int, lanes: int = 16) -> int:
    """Queries one pass of the weighted values takes: their accumulators, the value vectors and the broadcast
    weight fit the vector registers."""
    vectors = head_dim // lanes
    return max(1, min(MAX_GROUP, (REGISTERS[lanes] - vectors - 2) // vectors))


@numba.njit(cache=True)
def scratch_floats(queries: int, count: int) -> int:
    """Floats of scratch a call for `queries` queries over `count` keys needs: each query's scores (padded to whole
    vectors of PAD floats), then each query's inverse sum, then each query's largest score (`sums_at`)."""
    return sums_at(queries, count) + 2 * queries


@numba.njit(cache=True)
def sums_at(queries: int, count: int) -> int:
    """Where in a call's scratch its queries' inverse sums start (the largest scores follow them): after each
    query's `count` scores padded to whole vectors of PAD floats."""
    return queries * ((count + PAD - 1) // PAD * PAD)


@functools.cache
def available(lanes: int = 16) -> bool:
    """Whether the kernel for vectors of `lanes` floats runs here: the CPU has the instructions (AVX-512 for 16,
    AVX2 and FMA for 8), the streamed kernels' conditions hold (`streamed_gemm.available`) and a small case comes
    within float32 rounding of the float64 attention (checked once per process and width)."""
    if lanes not in WIDTHS or host_lanes() < lanes or not streamed_gemm.available():
        return False
    try:
        generator = np.random.default_rng(0)
        queries = generator.standard_normal((3, 32), dtype=np.float32)
        keys, values = (generator.standard_normal((37, 32), dtype=np.float32) for _ in range(2))
        got = attend_queries(queries, keys, values, None, 0.25, lanes)
        scores = queries.astype(np.float64) @ keys.T.astype(np.float64) * 0.25
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        exact = weights / weights.sum(axis=1, keepdims=True) @ values.astype(np.float64)
        return bool(np.abs(got - exact).max() < 1e-5)
    except Exception:  # noqa: BLE001 — any failure to build or run the kernel means: not available here
        return False


def attend_queries(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray | None,
                   scale: float, lanes: int = 16) -> np.ndarray:
    """Softmax attention of `queries` [n, D] over `keys`, `values` [count, D] (float32, C-contiguous), with the
    additive `mask` [n, count] (or None), in one call of the compiled kernel for vectors of `lanes` floats (a
    plain-Python entry for tests and the self-check; generation calls it from `fused_kernels`)."""
    n, size = queries.shape
    count = keys.shape[0]
    out = np.empty((n, size), np.float32)
    scratch = np.empty(scratch_floats(n, count), np.float32)
    pointers = np.array([[queries[m].ctypes.data for m in range(n)],
                         [mask[m].ctypes.data if mask is not None else 0 for m in range(n)],
                         [out[m].ctypes.data for m in range(n)]], np.int64)
    function = ctypes.CFUNCTYPE(None, *([ctypes.c_int64] * 8), ctypes.c_float)(address(size, lanes))
    function(pointers[0].ctypes.data, pointers[1].ctypes.data, pointers[2].ctypes.data, n, keys.ctypes.data,
             values.ctypes.data, count, scratch.ctypes.data, scale)
    return out


@functools.cache
def address(head_dim: int, lanes: int = 16) -> int:
    """Address of the compiled `attend_queries` for heads of `head_dim` floats and vectors of `lanes` floats
    (compiled on first use, or loaded from the disk cache: `compiled_ir`)."""
    if not supports(head_dim, lanes):
        raise ValueError(f"the decode attention kernel for vectors of {lanes} floats takes heads of a multiple of "
                         f"{lanes} floats (lanes 16 or 8), got {head_dim}")
    return compiled_address(module_ir(head_dim, lanes), "attend_queries", f"decode-attention-{head_dim}-{lanes}")


@intrinsic
def call_attend_queries(typingctx, function, queries, masks, outs, n, keys, values, count, scratch, scale):
    """Call the compiled `attend_queries` at `function`: eight i64 arguments and a float."""
    return nb_types.void(*([nb_types.int64] * 9), nb_types.float32), call_codegen(8, with_float=True)


def module_ir(head_dim: int, lanes: int = 16) -> str:
    """LLVM module with `void attend_queries(i64 queries, i64 masks, i64 outs, i64 n, i64 keys, i64 values,
    i64 count, i64 scratch, float scale)`: for each of the n queries (`queries`, `masks`, `outs`: arrays of n
    pointers to its [D] query, its mask row of `count` floats or 0 for none, its [D] output), the attention over
    the `count` keys and values at `keys` / `values` ([count, D]); `scratch` holds `scratch_floats(n, count)`."""
    w = Width(lanes)
    vectors = head_dim // lanes
    lines = vector_declarations(lanes) + [
        f"declare {w.vec} @llvm.masked.load.v{w.lanes}f32.p0(ptr, i32, {w.mask}, {w.vec})",
        "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)",
        "define void @attend_queries(i64 %qa, i64 %ma, i64 %oa, i64 %n, i64 %ka, i64 %va, i64 %count, i64 %sa, "
        "float %scale) {", "entry:"]
    lines += _entry(w)
    lines += _block_scores(w, head_dim, vectors)
    lines += _tail_scores(w, head_dim, vectors)
    lines += _softmax(w)
    lines += _weighted(w, head_dim, vectors, group_size(head_dim, lanes))
    lines += ['!0 = distinct !{!0, !1}', '!1 = !{!"llvm.loop.unroll.disable"}']
    return "\n".join(lines)


def _entry(w: Width) -> list[str]:
    """The entry block: pointers, the padded row length of the scratch, the end of the whole key blocks."""
    out = ["  %qs = inttoptr i64 %qa to ptr", "  %ms = inttoptr i64 %ma to ptr", "  %os = inttoptr i64 %oa to ptr",
           "  %k = inttoptr i64 %ka to ptr", "  %v = inttoptr i64 %va to ptr", "  %sc = inttoptr i64 %sa to ptr",
           f"  %pad1 = add i64 %count, {PAD - 1}", f"  %padded = and i64 %pad1, -{PAD}",
           "  %inv_at = mul i64 %n, %padded", "  %invs = getelementptr float, ptr %sc, i64 %inv_at",
           "  %tops = getelementptr float, ptr %invs, i64 %n",
           f"  %blocks_end = and i64 %count, -{w.lanes}"]
    out += w.splat("scalev", "%scale")
    return out + ["  br label %kb_test"]


def _query(w: Width, index: str, tag: str, vectors: int) -> list[str]:
    """IR: %{tag}q{v} = the query vectors of query `index` (its pointer read from the queries' array)."""
    out = [f"  %{tag}qpp = getelementptr i64, ptr %qs, i64 {index}", f"  %{tag}qa = load i64, ptr %{tag}qpp",
           f"  %{tag}qp = inttoptr i64 %{tag}qa to ptr"]
    for v in range(vectors):
        out += [f"  %{tag}qp{v} = getelementptr float, ptr %{tag}qp, i64 {v * w.lanes}",
                f"  %{tag}q{v} = load {w.vec}, ptr %{tag}qp{v}, align 4"]
    return out


def _block_scores(w: Width, head_dim: int, vectors: int) -> list[str]:
    """IR: the loop over whole blocks of keys (one a lane), and inside it the loop over the queries: each query's
    chains, one a key, the tree of pairwise sums (key j's score lands in lane j), scaled, stored at
    scratch[m · padded + s]."""
    out = ["kb_test:", "  %s = phi i64 [0, %entry], [%s_next, %kb_next]", "  %kb_more = icmp slt i64 %s, %blocks_end",
           "  br i1 %kb_more, label %kb_fetch, label %tail_test"]
    out += _prefetches(w, head_dim)
    out += ["  br label %bq", "bq:", "  %m = phi i64 [0, %kb_fetch], [%m_next, %bq]"]
    out += _query(w, "%m", "b", vectors)
    for j in range(w.lanes):
        out += [f"  %slot{j} = add i64 %s, {j}", f"  %off{j} = mul i64 %slot{j}, {head_dim}",
                f"  %kp{j} = getelementptr float, ptr %k, i64 %off{j}"]
        out += chain(w, f"c{j}", "bq", f"kp{j}", vectors)
    level, width = [f"c{j}" for j in range(w.lanes)], 0
    while len(level) > 1:
        width += 1
        names = [f"r{width}_{j}" for j in range(len(level) // 2)]
        for j, name in enumerate(names):
            out += pairwise(w, name, level[2 * j], level[2 * j + 1])
        level = names
    out += [f"  %bscaled = fmul {w.vec} %{level[0]}, %scalev", "  %brow = mul i64 %m, %padded",
            "  %bat = add i64 %brow, %s", "  %bop = getelementptr float, ptr %sc, i64 %bat",
            f"  store {w.vec} %bscaled, ptr %bop, align 4", "  %m_next = add i64 %m, 1",
            "  %m_more = icmp slt i64 %m_next, %n", "  br i1 %m_more, label %bq, label %kb_next, !llvm.loop !0",
            "kb_next:", f"  %s_next = add i64 %s, {w.lanes}", "  br label %kb_test"]
    return out


def _prefetches(w: Width, head_dim: int) -> list[str]:
    """IR: block `kb_fetch`, at the start of the key block at slot %s: the keys of the block AHEAD_SLOTS slots on
    prefetched into L1, and this block's values into L2 for the weighted values (a block of 16 keys of 64 floats
    is a 4 KB page, where the CPU's own prefetcher stops)."""
    out = ["kb_fetch:", f"  %fk_at = mul i64 %s, {head_dim}", "  %fk = getelementptr float, ptr %k, i64 %fk_at",
           f"  %fk_ahead = getelementptr float, ptr %fk, i64 {AHEAD_SLOTS * head_dim}",
           "  %fv = getelementptr float, ptr %v, i64 %fk_at"]
    for line in range(w.lanes * head_dim * 4 // 64):
        out += [f"  %fkl{line} = getelementptr i8, ptr %fk_ahead, i64 {64 * line}",
                f"  call void @llvm.prefetch.p0(ptr %fkl{line}, i32 0, i32 3, i32 1)",
                f"  %fvl{line} = getelementptr i8, ptr %fv, i64 {64 * line}",
                f"  call void @llvm.prefetch.p0(ptr %fvl{line}, i32 0, i32 2, i32 1)"]
    return out


def _tail_scores(w: Width, head_dim: int, vectors: int) -> list[str]:
    """IR: the keys past the last whole block one by one, each query's chain through the same tree (lane 0)."""
    out = ["tail_test:", "  %t = phi i64 [%blocks_end, %kb_test], [%t_next, %tq_done]",
           "  %t_more = icmp slt i64 %t, %count", "  br i1 %t_more, label %tq_start, label %soft",
           "tq_start:", f"  %toff = mul i64 %t, {head_dim}", "  %tkp = getelementptr float, ptr %k, i64 %toff",
           "  br label %tq", "tq:", "  %tm = phi i64 [0, %tq_start], [%tm_next, %tq]"]
    out += _query(w, "%tm", "t", vectors)
    out += chain(w, "u", "tq", "tkp", vectors)
    previous = "u"
    for level in range(1, w.levels + 1):  # the levels of the block's tree; lane 0 ends as the key's score
        out += pairwise(w, f"u{level}", previous, previous)
        previous = f"u{level}"
    out += [f"  %tdot = extractelement {w.vec} %{previous}, i32 0", "  %tscore = fmul float %tdot, %scale",
            "  %trow = mul i64 %tm, %padded", "  %tat = add i64 %trow, %t",
            "  %tsp = getelementptr float, ptr %sc, i64 %tat", "  store float %tscore, ptr %tsp, align 4",
            "  %tm_next = add i64 %tm, 1", "  %tm_more = icmp slt i64 %tm_next, %n",
            "  br i1 %tm_more, label %tq, label %tq_done", "tq_done:", "  %t_next = add i64 %t, 1",
            "  br label %tail_test"]
    return out


def _valid(w: Width, tag: str, at: str) -> list[str]:
    """IR: %{tag} = which lanes of the vector of slots at, at + 1, … are keys (slot < count)."""
    return [f"  %{tag}_left = sub i64 %count, {at}",
            f"  %{tag}_lh = insertelement <{w.lanes} x i64> poison, i64 %{tag}_left, i32 0",
            f"  %{tag}_lv = shufflevector <{w.lanes} x i64> %{tag}_lh, <{w.lanes} x i64> poison, <{w.lanes} x i32> "
            "zeroinitializer", f"  %{tag} = icmp slt <{w.lanes} x i64> {w.index}, %{tag}_lv"]


def _maximum(w: Width, loop: str, masked: bool) -> list[str]:
    """IR: the loop `loop` over a query's scores (row %sr) taking their maximum into %{loop}_top_next; `masked`: the
    mask row (%smp) added first and the sums stored back. Without a mask the row is only read: a masked load from
    no row at all (every lane off) takes a fault-suppression assist with AVX2 on AMD CPUs (the 8-float kernel ran
    2.5x slower at one row)."""
    low = w.const(NEGATIVE_INFINITY)
    out = [f"{loop}:", f"  %{loop}_x = phi i64 [0, %sq], [%{loop}_x_next, %{loop}]",
           f"  %{loop}_top = phi {w.vec} [{low}, %sq], [%{loop}_top_next, %{loop}]",
           f"  %{loop}_xp = getelementptr float, ptr %sr, i64 %{loop}_x",
           f"  %{loop}_xs = load {w.vec}, ptr %{loop}_xp, align 4"]
    out += _valid(w, f"{loop}_in", f"%{loop}_x")
    value = f"%{loop}_xs"
    if masked:
        out += [f"  %{loop}_mp = getelementptr float, ptr %smp, i64 %{loop}_x",
                f"  %{loop}_m = call {w.vec} @llvm.masked.load.v{w.lanes}f32.p0(ptr %{loop}_mp, i32 4, {w.mask} "
                f"%{loop}_in, {w.vec} zeroinitializer)", f"  %{loop}_xa = fadd {w.vec} %{loop}_xs, %{loop}_m",
                f"  store {w.vec} %{loop}_xa, ptr %{loop}_xp, align 4"]
        value = f"%{loop}_xa"
    return out + [f"  %{loop}_xv = select {w.mask} %{loop}_in, {w.vec} {value}, {w.vec} {low}",
                  f"  %{loop}_top_next = call {w.vec} @llvm.maxnum.v{w.lanes}f32({w.vec} %{loop}_top, "
                  f"{w.vec} %{loop}_xv)",
                  f"  %{loop}_x_next = add i64 %{loop}_x, {w.lanes}",
                  f"  %{loop}_more = icmp slt i64 %{loop}_x_next, %count",
                  f"  br i1 %{loop}_more, label %{loop}, label %ex_start"]


def _softmax(w: Width) -> list[str]:
    """IR: per query, a pass adding its mask row and taking the maximum, then a pass turning the scores into the
    weights (stored over them) and summing them lane by lane; the inverse of the sum stored after the scores, the
    maximum after the inverse sums (what `split_attention` needs to join the outputs of chunks of keys)."""
    low = w.const(NEGATIVE_INFINITY)
    out = ["soft:", "  br label %sq", "sq:", "  %sm = phi i64 [0, %soft], [%sm_next, %sq_done]",
           "  %srow = mul i64 %sm, %padded", "  %sr = getelementptr float, ptr %sc, i64 %srow",
           "  %smpp = getelementptr i64, ptr %ms, i64 %sm", "  %sma = load i64, ptr %smpp",
           "  %smp = inttoptr i64 %sma to ptr", "  %has_mask = icmp ne i64 %sma, 0",
           "  br i1 %has_mask, label %mx, label %mn"]
    out += _maximum(w, "mx", masked=True) + _maximum(w, "mn", masked=False)
    out += ["ex_start:", f"  %top_all = phi {w.vec} [%mx_top_next, %mx], [%mn_top_next, %mn]",
            f"  %stop = call nnan float @llvm.vector.reduce.fmax.v{w.lanes}f32({w.vec} %top_all)"]
    out += w.splat("stopv", "%stop")
    out += w.splat("floorv", float_literal(EXP_FLOOR))
    out += ["  br label %ex", "ex:", "  %e = phi i64 [0, %ex_start], [%e_next, %ex]",
            f"  %acc = phi {w.vec} [zeroinitializer, %ex_start], [%acc_next, %ex]",
            "  %ep = getelementptr float, ptr %sr, i64 %e", f"  %es = load {w.vec}, ptr %ep, align 4",
            f"  %ed = fsub {w.vec} %es, %stopv", f"  %ee = call {w.vec} @vexp({w.vec} %ed)",
            f"  %ekeep = fcmp oge {w.vec} %ed, %floorv"]
    out += _valid(w, "ein", "%e")
    out += [f"  %eok = and {w.mask} %ekeep, %ein",
            f"  %ew = select {w.mask} %eok, {w.vec} %ee, {w.vec} zeroinitializer",
            f"  store {w.vec} %ew, ptr %ep, align 4", f"  %acc_next = fadd {w.vec} %acc, %ew",
            f"  %e_next = add i64 %e, {w.lanes}", "  %e_more = icmp slt i64 %e_next, %count",
            "  br i1 %e_more, label %ex, label %sq_done", "sq_done:",
            f"  %ssum = call float @llvm.vector.reduce.fadd.v{w.lanes}f32(float -0.0, {w.vec} %acc_next)",
            "  %sinv = fdiv float 1.0, %ssum", "  %sip = getelementptr float, ptr %invs, i64 %sm",
            "  store float %sinv, ptr %sip, align 4", "  %stp = getelementptr float, ptr %tops, i64 %sm",
            "  store float %stop, ptr %stp, align 4", "  %sm_next = add i64 %sm, 1",
            "  %sm_more = icmp slt i64 %sm_next, %n", "  br i1 %sm_more, label %sq, label %wg_test"]
    return out


def _weighted(w: Width, head_dim: int, vectors: int, group: int) -> list[str]:
    """IR: the queries GROUP at a time (the last few in a pass of their own size), each pass a function of its
    own (`_weighted_pass`; inlined, LLVM merged the passes' loops into one that kept its pointers in memory)."""
    sizes = range(1, group + 1)
    out = ["wg_test:", "  %g = phi i64 [0, %sq_done]" + "".join(f", [%g_after{k}, %ws{k}]" for k in sizes),
           "  %g_left = sub i64 %n, %g", "  %g_done = icmp sle i64 %g_left, 0",
           "  br i1 %g_done, label %exit, label %wg_pick", "wg_pick:", f"  %g_big = icmp sge i64 %g_left, {group}",
           f"  %g_size = select i1 %g_big, i64 {group}, i64 %g_left",
           "  switch i64 %g_size, label %exit [" + " ".join(f"i64 {k}, label %ws{k}" for k in sizes) + "]"]
    for k in range(1, group + 1):
        out += [f"ws{k}:",
                f"  call void @pass{k}(i64 %g, i64 %padded, i64 %count, ptr %sc, ptr %v, ptr %invs, ptr %os)",
                f"  %g_after{k} = add i64 %g, {k}", "  br label %wg_test"]
    out += ["exit:", "  ret void", "}"]
    for k in range(1, group + 1):
        out += _weighted_pass(w, k, head_dim, vectors)
    return out


def _weighted_pass(w: Width, k: int, head_dim: int, vectors: int) -> list[str]:
    """IR: `pass{k}`, the weighted values of queries g … g + k − 1: one loop over the slots, the value vectors
    loaded once for the k queries, each query's output one chain of multiply-adds per vector in slot order; then each
    output times its inverse sum, stored through its pointer."""
    out = [f"define internal void @pass{k}(i64 %g, i64 %padded, i64 %count, ptr %sc, ptr %v, ptr %invs, ptr %os) "
           "noinline {", "entry:"]
    for q in range(k):
        out += [f"  %m{q} = add i64 %g, {q}", f"  %row{q} = mul i64 %m{q}, %padded",
                f"  %r{q} = getelementptr float, ptr %sc, i64 %row{q}"]
    out += ["  br label %loop", "loop:", "  %s = phi i64 [0, %entry], [%s_next, %loop]"]
    for q in range(k):
        out += [f"  %a{q}_{v} = phi {w.vec} [zeroinitializer, %entry], [%n{q}_{v}, %loop]" for v in range(vectors)]
    out += [f"  %off = mul i64 %s, {head_dim}", "  %vp = getelementptr float, ptr %v, i64 %off"]
    for v in range(vectors):
        out += [f"  %vp{v} = getelementptr float, ptr %vp, i64 {v * w.lanes}",
                f"  %v{v} = load {w.vec}, ptr %vp{v}, align 4"]
    for q in range(k):
        out += [f"  %wp{q} = getelementptr float, ptr %r{q}, i64 %s", f"  %w{q} = load float, ptr %wp{q}, align 4"]
        out += w.splat(f"b{q}", f"%w{q}")
        out += [f"  %n{q}_{v} = call {w.vec} @llvm.fma.v{w.lanes}f32({w.vec} %b{q}, {w.vec} %v{v}, {w.vec} %a{q}_{v})"
                for v in range(vectors)]
    out += ["  %s_next = add i64 %s, 1", "  %more = icmp slt i64 %s_next, %count",
            "  br i1 %more, label %loop, label %done", "done:"]
    for q in range(k):
        out += [f"  %ip{q} = getelementptr float, ptr %invs, i64 %m{q}", f"  %i{q} = load float, ptr %ip{q}, align 4"]
        out += w.splat(f"iv{q}", f"%i{q}")
        out += [f"  %opp{q} = getelementptr i64, ptr %os, i64 %m{q}", f"  %oa{q} = load i64, ptr %opp{q}",
                f"  %op{q} = inttoptr i64 %oa{q} to ptr"]
        for v in range(vectors):
            out += [f"  %o{q}_{v} = fmul {w.vec} %n{q}_{v}, %iv{q}",
                    f"  %ov{q}_{v} = getelementptr float, ptr %op{q}, i64 {v * w.lanes}",
                    f"  store {w.vec} %o{q}_{v}, ptr %ov{q}_{v}, align 4"]
    return out + ["  ret void", "}"]
