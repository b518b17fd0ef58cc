"""A prompt's causal attention on AVX-512, compiled for the host CPU: the prefill's attention, tile by tile.

A prompt's prefill is most of a grounded request's time (the suite's retrieval and summarization prompts, ~730
tokens: 56–59% of lookahead's whole call), and its attention was ~29% of the prefill: PyTorch's CPU flash attention
took 4.7–5.5 ms a layer for 660 tokens (the default model's 9 query and 3 key/value heads of 64, 2 threads, Zen 5),
~100 GFLOP/s of causal work. Here each tile of ROWS query rows of one head runs through the keys it may see,
BLOCK at a time: a loop over the head's steps scores the block (each row's input broadcast against vectors of 16
keys of the transposed keys, SCORE_CHAINS chains of multiply-adds a row), then the online softmax's update — the
block's maximum over the keys the row sees (position ≤ its own: causal), the weights p = exp(s − max) (zero for
keys it does not see; a Cephes-style polynomial, as accurate as expf), the running sum and the output accumulators
rescaled by exp(old max − new max) — then a loop over the block's keys adds p · value into the ROWS × D/16
accumulators, which stay in registers; at the end each row is its accumulators divided by its running sum. The
two loops are kept as loops (UNROLL steps a turn): fully unrolled, LLVM's schedule spilled hundreds of vectors.

660 tokens of the default model's heads (2 threads, medians of 31, in one process): 1.44–1.50 ms a layer against
SDPA's 4.7–4.9 ms; 4 × 16 rows × keys 1.67, 2 × 32 2.13, 5 × 32 1.47, 4 × 48 1.44, 4 × 64 1.55 ms; unrolled
loops 2.6–3.9 ms. The sums run in another order than SDPA's, so the output differs from SDPA's in the last bits —
no further from the float64 attention than SDPA's own (tested) — as lookahead's other kernels do (README, "What it
does"). Used for float32 prefills of one sequence on CPUs with AVX-512 whose head size is a multiple of 16,
without a mask (causal) or with the causal mask of a prompt after cached positions (a reused prompt cache:
`attention._prefill_eligible` checks it), without a sliding window or attention weights (`eligible`); everything
else keeps SDPA.
"""

from __future__ import annotations

import functools

import numba
import torch
from numba import types as nb_types
from numba.extending import intrinsic

from . import streamed_gemm
from .compiled_ir import call_codegen, compiled_addresses, host_features
from .thread_governor import numba_threads
from .vector_ir import LANES, NEGATIVE_INFINITY, VEC, splat, splat_const, vector_declarations

ROWS = 4  # query rows of one tile
BLOCK = 32  # keys a tile scores at once (a multiple of LANES)
SCORE_CHAINS = 4  # independent multiply-add chains of a row's scores over the block's vectors of keys
UNROLL = 4  # steps of the head (keys of the block) a turn of the scores' (values') loop


@functools.cache
def available() -> bool:
    """Whether the kernel runs here: a CPU with AVX-512, the streamed kernels' conditions (llvmlite compiles, a
    thread-safe numba threading layer: `streamed_gemm.available`), and a small case computed within float32 rounding
    of the float64 attention (checked once per process)."""
    if "+avx512f" not in host_features().split(",") or not streamed_gemm.available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        query = torch.randn(1, 4, 37, 32, generator=generator)
        key, value = (torch.randn(1, 2, 40, 32, generator=generator) for _ in range(2))
        visible = torch.ones(37, 40, dtype=torch.bool).tril(3)
        exact = torch.nn.functional.scaled_dot_product_attention(
            query.double(), key.double(), value.double(), attn_mask=visible, enable_gqa=True).transpose(1, 2)
        got = causal_attention(query, key, value, 32 ** -0.5)
        return bool((got.double() - exact).abs().max() < 1e-5)
    except Exception:  # noqa: BLE001 — any failure to build or run the kernel means: not available here
        return False


def eligible(query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float, kwargs: dict,
             cached: int = 0) -> bool:
    """Whether a call is a causal prefill this kernel computes: float32 CPU tensors `[1, H, T, D]` / `[1, H_kv,
    cached + T, D]` with T > 1, H a multiple of H_kv, D a multiple of 16, no mask, no dropout, no gradient, no
    sliding window and no attention weights asked for, on an AVX-512 CPU. `cached` = 0: a whole prompt (SDPA's
    `is_causal`, which transformers implies without a mask, aligns the triangle to the top left, the same as the
    kernel's only when query and key lengths agree); > 0: a prompt after `cached` cached positions, for which
    transformers passes a mask the caller has checked to be the causal one (row i sees keys 0 … cached + i)."""
    if attention_mask is not None or dropout or query.is_cuda or query.dtype != torch.float32 or query.requires_grad:
        return False
    if kwargs.get("sliding_window") is not None or kwargs.get("output_attentions") or kwargs.get("is_causal") is False:
        return False
    if query.dim() != 4 or key.dim() != 4 or query.shape[0] != 1 or key.shape[0] != 1:
        return False
    heads, rows, size = query.shape[1:]
    return (rows > 1 and key.shape[2] == cached + rows and heads % key.shape[1] == 0 and size % LANES == 0
            and key.shape[3] == size and available())


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """`[1, T, H, D]` causal attention of `query` `[1, H, T, D]` at positions S − T … S − 1 over `key`, `value`
    `[1, H_kv, S, D]` (grouped: query head h reads key head h // (H / H_kv)), `scale` applied to the scores."""
    _, heads, rows, size = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    padded = -(-slots // BLOCK) * BLOCK
    keys_t = _blocked_keys(key[0], padded)
    values = torch.zeros(kv_heads, padded, size)
    values[:, :slots] = value[0]
    q = query[0].contiguous()
    out = torch.empty(1, rows, heads, size)
    threads = numba_threads(torch.get_num_threads())
    _launch(_address(size), q.data_ptr(), keys_t.data_ptr(), values.data_ptr(), out.data_ptr(), heads,
            heads // kv_heads, rows, slots - rows, padded, size, float(scale), ROWS, threads)
    return out


def _blocked_keys(key: torch.Tensor, padded: int) -> torch.Tensor:
    """key [H_kv, S, D] as [H_kv, S' / BLOCK, D, BLOCK]: each block of BLOCK keys transposed on its own (one
    contiguous 8 KB at heads of 64, read as a stream; the whole [D, S'] transpose made a block touch D pages),
    zero-padded to S' slots so that every block reads whole vectors."""
    kv_heads, slots, size = key.shape
    blocked = torch.zeros(kv_heads, padded // BLOCK, size, BLOCK)
    whole = slots // BLOCK
    blocked[:, :whole] = key[:, :whole * BLOCK].reshape(kv_heads, whole, BLOCK, size).transpose(2, 3)
    if slots > whole * BLOCK:
        blocked[:, whole, :, :slots - whole * BLOCK] = key[:, whole * BLOCK:].transpose(1, 2)
    return blocked


@functools.cache
def _address(size: int) -> int:
    """Address of the compiled tile kernel for heads of `size` floats (compiled on first use, ~0.1 s, or loaded
    from the disk cache: `compiled_ir`)."""
    return compiled_addresses(module_ir(size), ("attend_tile",), f"prefill-attention-{size}")[0]


@intrinsic
def _call_tile(typingctx, address, q, keys_t, values, out, valid, last, padded, out_stride, scale):
    """Call the compiled `attend_tile` at `address`: eight i64 arguments and a float."""
    return nb_types.void(*([nb_types.int64] * 9), nb_types.float32), call_codegen(8, with_float=True)


@numba.njit(parallel=True, nogil=True, cache=True)
def _launch(address, q, keys_t, values, out, heads, group, rows, start, padded, size, scale, tile_rows,
            threads):  # pragma: no cover - compiled
    """Every (head, tile of `tile_rows` rows) on `threads` threads, tiles dealt out in turn (later tiles see more
    keys)."""
    tiles = (rows + tile_rows - 1) // tile_rows
    items = heads * tiles
    for t in numba.prange(threads):
        for item in range(t, items, threads):
            head, tile = item // tiles, item % tiles
            first = tile * tile_rows
            kv = head // group
            _call_tile(address, q + 4 * (head * rows + first) * size, keys_t + 4 * kv * size * padded,
                       values + 4 * kv * padded * size, out + 4 * (first * heads + head) * size,
                       min(tile_rows, rows - first), start + first, padded, heads * size, numba.float32(scale))


def module_ir(size: int) -> str:
    """LLVM module with `void attend_tile(i64 q, i64 keys_t, i64 values, i64 out, i64 valid, i64 last, i64 padded,
    i64 out_stride, float scale)`: rows r < `valid` of the tile at `q` (`size` floats a row) attend over keys 0 …
    last + r of `keys_t` [padded / BLOCK, size, BLOCK] (`_blocked_keys`) and `values` [padded, size]; row r's
    output is stored at out + r · out_stride floats."""
    vectors = size // LANES
    lines = vector_declarations() + [
        "declare float @llvm.maxnum.f32(float, float)",
        "define void @attend_tile(i64 %qa, i64 %kta, i64 %va, i64 %outa, i64 %valid, i64 %last, i64 %padded, "
        "i64 %ostride, float %scale) {", "entry:"]
    lines += _entry(size)
    lines += _block(size, vectors)
    lines += _finish(vectors)
    lines += ['!0 = distinct !{!0, !1}', '!1 = !{!"llvm.loop.unroll.disable"}']
    return "\n".join(lines)


def _entry(size: int) -> list[str]:
    """The entry block: per tile row r its query pointer and last key (rows past `valid` repeat the last valid
    row), the number of key blocks, the scale as a vector and the lanes' offsets 0 … 15."""
    out = ["  %q = inttoptr i64 %qa to ptr", "  %kt = inttoptr i64 %kta to ptr", "  %v = inttoptr i64 %va to ptr",
           "  %o = inttoptr i64 %outa to ptr", "  %top = sub i64 %valid, 1",
           f"  %weights = alloca [{ROWS * BLOCK} x float], align 64"]
    for r in range(ROWS):
        out += [f"  %in{r} = icmp slt i64 {r}, %valid", f"  %rr{r} = select i1 %in{r}, i64 {r}, i64 %top",
                f"  %qo{r} = mul i64 %rr{r}, {size}", f"  %q{r} = getelementptr float, ptr %q, i64 %qo{r}",
                f"  %last{r} = add i64 %last, %rr{r}"]
    out += [f"  %blocks_m = udiv i64 %last{ROWS - 1}, {BLOCK}", "  %blocks = add i64 %blocks_m, 1"]
    out += splat("scalev", "%scale")
    for u in range(BLOCK // LANES):
        lanes = ", ".join(f"i64 {u * LANES + i}" for i in range(LANES))
        out.append(f"  %lanes{u} = add <{LANES} x i64> <{lanes}>, zeroinitializer")
    return out + ["  br label %block"]


def _block(size: int, vectors: int) -> list[str]:
    """One block of BLOCK keys for the tile's rows: the scores' loop over the head, the online softmax's update,
    the loop over the block's keys adding the weighted values."""
    out = ["block:", "  %b = phi i64 [0, %entry], [%b_next, %latch]"]
    for r in range(ROWS):
        out += [f"  %m{r} = phi float [{NEGATIVE_INFINITY}, %entry], [%mn{r}, %latch]",
                f"  %l{r} = phi float [0.0, %entry], [%ln{r}, %latch]"]
        out += [f"  %a{r}_{v} = phi {VEC} [zeroinitializer, %entry], [%an{r}_{v}, %latch]" for v in range(vectors)]
    out += [f"  %key0 = mul i64 %b, {BLOCK}", f"  %kbase = mul i64 %key0, {size}", "  br label %scores"]
    out += _scores(size)
    for r in range(ROWS):
        out += _softmax_row(r, vectors)
    out += _weighted_values(size, vectors)
    return out + ["latch:", "  %b_next = add i64 %b, 1", "  %more = icmp ult i64 %b_next, %blocks",
                  "  br i1 %more, label %block, label %done"]


def _scores(size: int) -> list[str]:
    """IR: the loop `scores` over the head's steps, UNROLL a turn, then in block `softmax` %s{r}_{u} = the scaled
    scores of row r against the block's keys 16u … 16u + 15 (SCORE_CHAINS multiply-add chains a row and turn, each
    on its own steps of the head, added at the end)."""
    units = BLOCK // LANES
    chains = max(1, SCORE_CHAINS // units)
    out = ["scores:", "  %d = phi i64 [0, %block], [%d_next, %scores]"]
    for r in range(ROWS):
        for u in range(units):
            out += [f"  %c{r}_{u}_{c} = phi {VEC} [zeroinitializer, %block], [%cn{r}_{u}_{c}, %scores]"
                    for c in range(chains)]
    current = {(r, u, c): f"%c{r}_{u}_{c}" for r in range(ROWS) for u in range(units) for c in range(chains)}
    for i in range(UNROLL):
        c = i % chains
        out += [f"  %dd{i} = add i64 %d, {i}", f"  %ko{i} = mul i64 %dd{i}, {BLOCK}",
                f"  %kx{i} = add i64 %ko{i}, %kbase", f"  %kp{i} = getelementptr float, ptr %kt, i64 %kx{i}"]
        for u in range(units):
            out += [f"  %kp{i}_{u} = getelementptr float, ptr %kp{i}, i64 {u * LANES}",
                    f"  %k{i}_{u} = load {VEC}, ptr %kp{i}_{u}, align 4"]
        for r in range(ROWS):
            out += [f"  %qp{r}_{i} = getelementptr float, ptr %q{r}, i64 %dd{i}",
                    f"  %qs{r}_{i} = load float, ptr %qp{r}_{i}, align 4"]
            out += splat(f"qv{r}_{i}", f"%qs{r}_{i}")
            for u in range(units):
                last = i + chains >= UNROLL
                name = f"%cn{r}_{u}_{c}" if last else f"%ci{r}_{u}_{i}"
                out.append(f"  {name} = call {VEC} @llvm.fma.v{LANES}f32({VEC} %qv{r}_{i}, {VEC} %k{i}_{u}, "
                           f"{VEC} {current[r, u, c]})")
                current[r, u, c] = name
    out += [f"  %d_next = add i64 %d, {UNROLL}", f"  %d_more = icmp ult i64 %d_next, {size}",
            "  br i1 %d_more, label %scores, label %softmax, !llvm.loop !0", "softmax:"]
    for r in range(ROWS):
        for u in range(units):
            total = f"%cn{r}_{u}_0"
            for c in range(1, chains):
                out.append(f"  %sum{r}_{u}_{c} = fadd {VEC} {total}, %cn{r}_{u}_{c}")
                total = f"%sum{r}_{u}_{c}"
            out.append(f"  %s{r}_{u} = fmul {VEC} {total}, %scalev")
    return out


def _softmax_row(r: int, vectors: int) -> list[str]:
    """IR for row r: which of the block's keys it sees (position ≤ its last key), the block's maximum over them,
    the new running maximum, the weights p (zero for keys it does not see) stored for the values' pass, the
    running sum and the accumulators rescaled by exp(old max − new max)."""
    units = BLOCK // LANES
    out = [f"  %kb{r} = sub i64 %last{r}, %key0",
           f"  %kbh{r} = insertelement <{LANES} x i64> poison, i64 %kb{r}, i32 0",
           f"  %kbv{r} = shufflevector <{LANES} x i64> %kbh{r}, <{LANES} x i64> poison, <{LANES} x i32> "
           "zeroinitializer"]
    top = None
    for u in range(units):
        out += [f"  %see{r}_{u} = icmp sle <{LANES} x i64> %lanes{u}, %kbv{r}",
                f"  %sm{r}_{u} = select <{LANES} x i1> %see{r}_{u}, {VEC} %s{r}_{u}, {VEC} "
                f"{splat_const(NEGATIVE_INFINITY)}"]
        if top is not None:
            out.append(f"  %smx{r}_{u} = call {VEC} @llvm.maxnum.v{LANES}f32({VEC} {top}, {VEC} %sm{r}_{u})")
        top = f"%sm{r}_{u}" if top is None else f"%smx{r}_{u}"
    out += [f"  %bm{r} = call nnan float @llvm.vector.reduce.fmax.v{LANES}f32({VEC} {top})",
            f"  %mn{r} = call float @llvm.maxnum.f32(float %m{r}, float %bm{r})"]
    out += splat(f"mnv{r}", f"%mn{r}")
    total = None
    for u in range(units):
        out += [f"  %x{r}_{u} = fsub {VEC} %s{r}_{u}, %mnv{r}", f"  %e{r}_{u} = call {VEC} @vexp({VEC} %x{r}_{u})",
                f"  %p{r}_{u} = select <{LANES} x i1> %see{r}_{u}, {VEC} %e{r}_{u}, {VEC} zeroinitializer",
                f"  %wp{r}_{u} = getelementptr float, ptr %weights, i64 {r * BLOCK + u * LANES}",
                f"  store {VEC} %p{r}_{u}, ptr %wp{r}_{u}, align 64"]
        if total is not None:
            out.append(f"  %pt{r}_{u} = fadd {VEC} {total}, %p{r}_{u}")
        total = f"%p{r}_{u}" if total is None else f"%pt{r}_{u}"
    out.append(f"  %dm{r} = fsub float %m{r}, %mn{r}")
    out += splat(f"dmv{r}", f"%dm{r}")
    out += [f"  %cv{r} = call {VEC} @vexp({VEC} %dmv{r})", f"  %cs{r} = extractelement {VEC} %cv{r}, i32 0",
            f"  %ps{r} = call reassoc float @llvm.vector.reduce.fadd.v{LANES}f32(float -0.0, {VEC} {total})",
            f"  %lc{r} = fmul float %l{r}, %cs{r}", f"  %ln{r} = fadd float %lc{r}, %ps{r}"]
    return out + [f"  %ar{r}_{v} = fmul {VEC} %a{r}_{v}, %cv{r}" for v in range(vectors)]


def _weighted_values(size: int, vectors: int) -> list[str]:
    """IR: the loop `values` over the block's keys, UNROLL a turn: each row's accumulators += p[row, key] ·
    value[key], key by key in order (p broadcast from where `_softmax_row` stored it)."""
    out = ["  br label %values", "values:", "  %j = phi i64 [0, %softmax], [%j_next, %values]"]
    for r in range(ROWS):
        out += [f"  %w{r}_{v} = phi {VEC} [%ar{r}_{v}, %softmax], [%an{r}_{v}, %values]" for v in range(vectors)]
    current = {(r, v): f"%w{r}_{v}" for r in range(ROWS) for v in range(vectors)}
    for i in range(UNROLL):
        out += [f"  %jj{i} = add i64 %j, {i}", f"  %vk{i} = add i64 %key0, %jj{i}",
                f"  %vo{i} = mul i64 %vk{i}, {size}"]
        for v in range(vectors):
            out += [f"  %vx{i}_{v} = add i64 %vo{i}, {v * LANES}",
                    f"  %vp{i}_{v} = getelementptr float, ptr %v, i64 %vx{i}_{v}",
                    f"  %vv{i}_{v} = load {VEC}, ptr %vp{i}_{v}, align 4"]
        for r in range(ROWS):
            out += [f"  %px{r}_{i} = add i64 %jj{i}, {r * BLOCK}",
                    f"  %pp{r}_{i} = getelementptr float, ptr %weights, i64 %px{r}_{i}",
                    f"  %pw{r}_{i} = load float, ptr %pp{r}_{i}, align 4"]
            out += splat(f"pv{r}_{i}", f"%pw{r}_{i}")
            for v in range(vectors):
                name = f"%an{r}_{v}" if i == UNROLL - 1 else f"%wi{r}_{v}_{i}"
                out.append(f"  {name} = call {VEC} @llvm.fma.v{LANES}f32({VEC} %pv{r}_{i}, {VEC} %vv{i}_{v}, "
                           f"{VEC} {current[r, v]})")
                current[r, v] = name
    return out + [f"  %j_next = add i64 %j, {UNROLL}", f"  %j_more = icmp ult i64 %j_next, {BLOCK}",
                  "  br i1 %j_more, label %values, label %latch, !llvm.loop !0"]


def _finish(vectors: int) -> list[str]:
    """The exit: each valid row's accumulators divided by its running sum, stored at its output row."""
    out = ["done:"]
    for r in range(ROWS):
        out += splat(f"lv{r}", f"%ln{r}")
        out += [f"  %st{r} = icmp slt i64 {r}, %valid", f"  br i1 %st{r}, label %store{r}, label %next{r}",
                f"store{r}:", f"  %oo{r} = mul i64 %ostride, {r}",
                f"  %op{r} = getelementptr float, ptr %o, i64 %oo{r}"]
        for v in range(vectors):
            out += [f"  %ov{r}_{v} = fdiv {VEC} %an{r}_{v}, %lv{r}",
                    f"  %opp{r}_{v} = getelementptr float, ptr %op{r}, i64 {v * LANES}",
                    f"  store {VEC} %ov{r}_{v}, ptr %opp{r}_{v}, align 4"]
        out += [f"  br label %next{r}", f"next{r}:"]
    return out + ["  ret void", "}"]
