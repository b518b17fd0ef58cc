"""A small-row fp32 CPU matmul that streams each weight from memory once for any row count: y = x @ Wᵀ.

A decode or verification step multiplies a few rows by every weight matrix of the model: the time is the time to
stream the weights from memory, and verifying k rows should cost about what one row costs. oneDNN's and MKL's
fp32 kernels do not get there on a 2-core CPU (oneDNN: 8 rows ≈ 1.3–1.5x one row; MKL: 4 rows ≈ 1.8x), because
their small-M paths either re-read the weights or leave the memory bus idle while computing. This kernel:

- holds the weight as column panels `[N / P, K, P]` (P = the vector width: 16 floats with AVX-512, 8 with AVX2),
  so one panel is one contiguous stream of K vectors;
- keeps all rows' accumulators of a panel in vector registers (one per row) and, per k, loads one weight
  vector, broadcasts x[m, k] and issues one fused multiply-add per row: the weights are read once per pass
  (`rows_per_pass()` rows); more rows are computed panel by panel in groups of that many, the later groups
  reading the panel from the core's caches, so the weights still stream from memory once;
- reads the rows' inputs transposed ([K, M], transposed by compiled code before the threads start), so one
  pointer serves every row (a pointer per row spilled general registers on AVX2 at 12 rows: 12 rows then cost
  1.5x 8 rows' time, now 1.1x);
- for 1–3 rows computes several panels at once (`panels_per_pass`): one row's sum is a chain of dependent
  multiply-adds that waits on their latency, and more panels are more independent chains;
- prefetches the weights `PREFETCH_STEPS` vectors ahead, so loads are in flight while the rows are computed (int8
  passes of several panels on AVX2: the same step of the next pass's panels, `INT8_PREFETCH_NEXT_PASS`);
- splits the panels between the threads (numba's parallel loop), each thread a contiguous range.

Every output row is the same sequence of multiply-adds (k = 0, 1, … K-1 in order) whatever the row count, so
a row's result does not depend on how many rows are computed with it (oneDNN and MKL switch kernels, and so
rounding, with the row count). The numbers differ from PyTorch's default matmul in the last bits, as oneDNN's do.

Weights with an exact 4-bit or 8-bit block form (models from Q4_0 / Q4_1 / Q8_0 GGUF files, the default model
among them) can stream from it instead ("affine4" / "scaled8" panels, `affine_weights`; kernel IR in
`affine_kernel`; on AVX2, register tiles in assembly for some row counts, `affine_tiles`): the same bits from 0.75 /
1.125 bytes per weight.

The kernels are LLVM IR generated here (one function per row count up to `rows_per_pass()`, and a dispatcher),
compiled for the host CPU with llvmlite (numba's own LLVM binding) once per process. `available()` is False when
llvmlite cannot compile them or the CPU lacks FMA; callers then keep the other kernels. Whether this kernel is
the fastest on a machine is measured (`calibration.row_kernels_for`), never assumed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba.core import types as nb_types
from numba.extending import intrinsic

from . import amx_int8, amx_kernel
from .affine_kernel import AFFINE_BLOCK, RECORD_FLOATS, affine_kernel_ir, panel_passes, store_sums
from .compiled_ir import call_codegen, compiled_addresses, host_features
from .thread_governor import numba_threads

# Weight vectors prefetched ahead: 4 KB with AVX-512 (measured: 4–32 too close, 128–256 no better, 512 worse). A
# prefetch past the end of the panels is harmless (x86 prefetches never fault).
PREFETCH_STEPS = 64
AMX_KINDS = {amx_kernel.KIND: amx_kernel, amx_int8.KIND: amx_int8}  # tile kernels by the kind of records they read
# A tile kernel's product of more than this many groups of 16 rows (a prompt's) has its rows prepared by all the
# threads (`_launch_groups`), not by one before they start: one layer's four products of a 660-row prefill of the
# default model spent ~1.1 ms of ~11 ms preparing (Intel Xeon, 2 threads).
PREPARED_APART = 4
_TILE_GROUP = amx_kernel.GROUP  # rows of a tile kernel's group (both kernels' dispatchers share it)
# int8 kernels that compute several panels a pass (`panels_per_pass`) prefetch, at each step, the same step of the
# panel one pass ahead instead (`together` panels of K int8 vectors further) — by vector width. Measured on AVX2
# (Zen 3, 2 threads, the default model's int8 LM head [49152, 576] after a read of 160 MB, medians): 1 / 2 / 3 rows
# 2.39 / 2.87 / 3.01 ms → 1.67 / 1.87 / 2.13 ms; in generation (in-process A/B, chat, code and summarization prompts)
# the forward 17.4 → 16.7 ms a speculative step, 14.9 → 14.6 ms a plain one. Not measured with AVX-512.
INT8_PREFETCH_NEXT_PASS = {8: True, 16: False}
SAFE_THREADING_LAYERS = ("omp", "tbb")
_ARGS = ("rows", "x", "xs", "w", "y", "k", "n", "lo", "hi")  # every kernel argument is an i64 (pointers as integers)


@dataclass(frozen=True)
class StreamedWeight:
    """A weight [N, K] laid out as column panels for the streamed kernel; `panels` is [N_pad / P, K, P]
    (zero rows pad N to a multiple of P); `bias` [N] or None. float32 panels hold the weight itself; int8 panels
    (`quantize`) hold it rounded to `scales[n] · panels[…, n]`, and the product scales its output by `scales`;
    "affine4", "affine4h" and "scaled8" panels [N_pad / P, K / 32, W, P] (W = 6, 5 or 9 int32 words a record) hold
    it exactly in 4-bit or 8-bit block form (`affine_weights`); "amx4" records [N_pad / 16, K / 32, 320] bytes hold
    a 4-bit block form for the AMX kernel (`amx_kernel`), "amx8" records [N_pad / 16, K / 32, 576] an 8-bit one for
    the AMX-INT8 kernel (`amx_int8`)."""

    panels: torch.Tensor
    out_features: int
    bias: torch.Tensor | None
    scales: torch.Tensor | None = None
    kind: str = "float32"  # "float32", "int8", "affine4", "affine4h", "scaled8" (`affine_weights`), "amx4", "amx8"

    @property
    def in_features(self) -> int:
        """K, the width of the rows this weight multiplies."""
        k = self.panels.shape[1]
        return k * AFFINE_BLOCK if self.kind in RECORD_FLOATS or self.kind in AMX_KINDS else k


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> StreamedWeight:
    """The streamed layout of an fp32 weight [N, K] (and its bias [N]). Raises `ValueError` for another dtype
    or shape."""
    return pack_stacked([weight], bias)


def pack_stacked(weights: list[torch.Tensor], bias: torch.Tensor | None = None) -> StreamedWeight:
    """The streamed layout of fp32 weights [N_i, K] stacked by rows (N = Σ N_i; `bias` [N] or None), written
    straight into the panels: no stacked or transposed copy of the weights is made on the way (for the default
    model's LM head that would be two 113 MB temporaries). Raises `ValueError` for another dtype or shape."""
    for weight in weights:
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] != weights[0].shape[1]:
            raise ValueError(f"streamed_gemm packs 2-D float32 weights of one width, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
    panels = _panels([weight.detach() for weight in weights], torch.float32)
    return StreamedWeight(panels, sum(w.shape[0] for w in weights),
                          None if bias is None else bias.detach().contiguous())


def pack_rows(weight: torch.Tensor, rows: np.ndarray) -> StreamedWeight:
    """The streamed layout of `weight[rows]` (fp32 [N, K] contiguous, `rows` [n] int64 in range), gathered straight
    into the panels in one compiled call: the same panels as `pack(weight[rows])` without its gathered copy and
    per-block copies (for the LM head's few candidate tokens each greedy step, ~0.2 ms of Python in situ)."""
    width, k = vector_width(), weight.shape[1]
    panels = torch.empty(-(-len(rows) // width), k, width, dtype=torch.float32)
    _gather_rows(weight.detach().numpy(), rows, panels.numpy())
    return StreamedWeight(panels, len(rows), None)


@numba.njit(cache=True, nogil=True)
def _gather_rows(weight, rows, panels):  # pragma: no cover - compiled
    """panels[r // P, :, r % P] = weight[rows[r]] for every r, and 0 in the padding columns of the last panel."""
    width = panels.shape[2]
    for r in range(rows.shape[0]):
        source = weight[rows[r]]
        block, lane = r // width, r % width
        for k in range(panels.shape[1]):
            panels[block, k, lane] = source[k]
    for r in range(rows.shape[0], panels.shape[0] * width):
        panels[r // width, :, r % width] = 0


def quantize(weight: torch.Tensor) -> StreamedWeight:
    """An fp32 weight [N, K] rounded to int8 panels with one scale per output row (max |w| / 127, symmetric; an
    all-zero row gets scale 1): a quarter of the bytes to stream, for products that only need to be near (see
    `argmax_head`). Raises `ValueError` for another dtype or shape."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"streamed_gemm quantizes 2-D float32 weights, got {weight.dtype} {tuple(weight.shape)}")
    source = weight.detach().contiguous()
    scales = torch.empty(source.shape[0], dtype=torch.float32)
    rounded = torch.empty(source.shape, dtype=torch.int8)
    _round_rows(source.numpy(), scales.numpy(), rounded.numpy())
    return StreamedWeight(_panels([rounded], torch.int8), source.shape[0], None, scales, "int8")


@numba.njit(cache=True, nogil=True, parallel=True)
def _round_rows(weight, scales, rounded):  # pragma: no cover - compiled
    """Row by row (in parallel): scales[n] = max_k |weight[n, k]| / 127 (float32; 1 for an all-zero row) and
    rounded[n, k] = round(weight[n, k] / scales[n]) (float32 division, halves to even) clamped to ±127."""
    for n in numba.prange(weight.shape[0]):
        top = np.float32(0.0)
        for k in range(weight.shape[1]):
            top = max(top, abs(weight[n, k]))
        scale = top / np.float32(127.0) if top > 0 else np.float32(1.0)
        scales[n] = scale
        for k in range(weight.shape[1]):
            rounded[n, k] = min(max(np.rint(weight[n, k] / scale), np.float32(-127.0)), np.float32(127.0))


def _panels(weights: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Panels [N_pad / P, K, P] of `dtype` holding the rows of `weights` (each [N_i, K]) stacked, zero padded."""
    width, k = vector_width(), weights[0].shape[1]
    n = sum(weight.shape[0] for weight in weights)
    panels = torch.empty(-(-n // width), k, width, dtype=dtype)
    rows = panels.permute(0, 2, 1)  # [N_pad / P, P, K]: row r of the stack is rows[r // P, r % P]
    start = 0
    for weight in weights:
        _fill_rows(rows, weight, start)
        start += weight.shape[0]
    if n % width:
        rows[n // width, n % width:] = 0  # the padding rows
    return panels


def _fill_rows(rows: torch.Tensor, weight: torch.Tensor, start: int) -> None:
    """Write `weight` [n, K] as rows start .. start + n - 1 of the panel view `rows` [N_pad / P, P, K]: whole
    panels in one copy, a partial panel at either end row by row range."""
    width, n, done = rows.shape[1], weight.shape[0], 0
    while done < n:
        block, offset = divmod(start + done, width)
        if offset == 0 and n - done >= width:
            count = (n - done) // width
            rows[block: block + count].copy_(weight[done: done + count * width].reshape(count, width, -1))
            done += count * width
        else:
            take = min(width - offset, n - done)
            rows[block, offset: offset + take].copy_(weight[done: done + take])
            done += take


def product(x: torch.Tensor, weight: StreamedWeight) -> torch.Tensor:
    """x [M, K] (fp32, any M ≥ 1) → [M, N]: `x @ Wᵀ + bias`, in one pass over the weights (panel by panel, the
    rows in groups of at most `rows_per_pass()`). Raises `ValueError` when x is not a 2-D float32 tensor of the
    weight's width.

    A step calls this ~120 times between weight streams that evict the interpreter's working set, so each Python
    operation here costs microseconds: the pointers are computed, not sliced."""
    panels, k = weight.panels, weight.in_features
    blocks = panels.shape[0]
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"streamed_gemm needs float32 x [M, {k}], got {x.dtype} {tuple(x.shape)}")
    rows, n = x.shape[0], blocks * vector_width()
    x = x.contiguous()
    # [K, M]: step k's inputs side by side (the AMX kernel's pieces and block sums, `amx_kernel.scratch_floats`)
    xt = x if rows == 1 else torch.empty(scratch_floats(weight.kind, rows, k), dtype=torch.float32)
    out = torch.empty(rows, n, dtype=torch.float32)
    threads = min(numba_threads(torch.get_num_threads()), blocks)
    address, transpose = _kernel_address(weight.kind)
    if weight.kind in AMX_KINDS and rows > PREPARED_APART * _TILE_GROUP:
        _launch_groups(address, transpose, rows, x.data_ptr(), xt.data_ptr(), panels.data_ptr(), out.data_ptr(), k,
                       n, blocks, threads, AMX_KINDS[weight.kind].group_bytes(k))
    else:
        _launch(address, transpose, rows, x.data_ptr(), xt.data_ptr(), panels.data_ptr(), out.data_ptr(), k, n,
                blocks, threads)
    if n != weight.out_features:
        out = out[:, :weight.out_features].contiguous()
    if weight.scales is not None:
        out *= weight.scales
    if weight.bias is not None:
        out += weight.bias
    return out


@functools.cache
def available() -> bool:
    """Whether the kernels compile on this machine (llvmlite with opaque pointers, a CPU with FMA), compute a
    product right (checked once against float64 on a small case) and run on a thread-safe numba threading layer
    (OpenMP or TBB: numba's fallback "workqueue" layer aborts the process when two threads launch at once, and
    measured 2x slower here)."""
    try:
        features = host_features()
        if "+fma" not in features and "+avx512f" not in features:
            return False
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(3 * vector_width() + 5, 37, generator=generator)
        x = torch.randn(rows_per_pass() + 3, 37, generator=generator)
        got = product(x, pack(weight))
        right = torch.allclose(got.double(), x.double() @ weight.double().T, atol=1e-4, rtol=1e-4)
        return bool(right) and numba.threading_layer() in SAFE_THREADING_LAYERS
    except Exception:  # noqa: BLE001 — any failure to build or run the kernel means: not available here
        return False


@functools.cache
def vector_width() -> int:
    """Floats per vector register the kernels use: 16 with AVX-512, else 8."""
    return 16 if "+avx512f" in host_features() else 8


def rows_per_pass() -> int:
    """Rows computed together in one pass over a panel: one accumulator register per row (32 vector registers with
    AVX-512, 16 with AVX2) leaves room for the weight vector and the broadcast."""
    return 16 if vector_width() == 16 else 12


# Panels a kernel of k rows computes at once, by vector width and panel element type (measured on the default
# model's LM head, 2 threads, ms: AVX2, int8 1 row 2.27 → 1.94 with 3 panels, 3 rows 2.32 → 2.02, float32 1 row
# 5.4 → 4.6 with 2 panels; AVX-512 (Zen 5, its caches flushed before each call as in a step, medians of 30,
# interleaved), int8 3 → 6 panels: 1 row 0.64 → 0.63, 2 rows 0.83 → 0.76, 3 rows 0.87 → 0.76, and 4 panels no
# better than 3); row counts not listed: one panel. One row's sum is a chain of dependent multiply-adds, so a lone
# panel waits on the multiply-add's latency; more panels are independent chains.
PANELS_PER_PASS = {8: {"int8": {1: 3, 2: 3, 3: 3}, "float32": {1: 2, 2: 2}},
                   16: {"int8": {1: 6, 2: 6, 3: 6}, "float32": {1: 2, 2: 2}}}


def panels_per_pass(weights: str, rows: int, width: int) -> int:
    """Panels a kernel of `rows` rows on `weights` panels ("float32" or "int8") of `width` floats computes at once
    (`PANELS_PER_PASS`)."""
    return PANELS_PER_PASS[width].get(weights, {}).get(rows, 1)


def kernel_ir(rows: int, width: int, prefetch: int = PREFETCH_STEPS, name: str = "panel_rows",
              weights: str = "float32") -> str:
    """LLVM IR of `void name(i64 x, i64 xs, i64 w, i64 y, i64 K, i64 N, i64 lo, i64 hi)`: for panels
    lo ≤ b < hi, y[m, b·P + j] = Σ_k x[k·xs + m] · w[b, k, j] for the `rows` rows m, P = `width`. x holds the
    rows transposed, [K, xs] with xs ≥ rows, so one pointer reaches every row's input at step k (with a pointer
    per row, 12 rows ran out of AVX2's 16 general registers); y is [rows, N]. `panels_per_pass` panels at a time,
    those left over one by one; each column's sum is the same k = 0 … K-1 chain either way.
    `weights`: the panels' element type, "float32" or "int8" (converted exactly to float before the
    multiply-add; `prefetch` then counts float32 vectors' worth of bytes, so both look as far ahead, except where
    `INT8_PREFETCH_NEXT_PASS`: passes of several int8 panels prefetch the same step one pass ahead)."""
    together = panels_per_pass(weights, rows, width)
    out = [f"define internal void @{name}(i64 %xa, i64 %xs, i64 %wa, i64 %ya, i64 %K, i64 %N, i64 %lo, i64 %hi) {{",
           "entry:\n  %x = inttoptr i64 %xa to ptr\n  %w = inttoptr i64 %wa to ptr\n  %y = inttoptr i64 %ya to ptr"]
    out += panel_passes(together, lambda tag, n, edges: _panels_loop(tag, rows, n, width, prefetch, weights, edges))
    return "\n".join(out)


def _panels_loop(tag: str, rows: int, together: int, width: int, prefetch: int, weights: str,
                 edges: tuple) -> list[str]:
    """IR blocks `{tag}panel`… computing `together` panels per iteration for b = first, first + together, … < end;
    `edges` = (block it is entered from, first, end, block to branch to when done)."""
    enter, first, end, leave = edges
    vec = f"<{width} x float>"
    out = [f"{tag}panel:\n  %{tag}b = phi i64 [{first}, %{enter}], [%{tag}b_next, %{tag}store]",
           f"  %{tag}done = icmp sge i64 %{tag}b, {end}\n  br i1 %{tag}done, label %{leave}, label %{tag}start",
           f"{tag}start:"]
    out += [f"  %{tag}pb{c} = add i64 %{tag}b, {c}\n  %{tag}base{c} = mul i64 %{tag}pb{c}, %K" for c in range(together)]
    if weights == "int8" and together > 1 and INT8_PREFETCH_NEXT_PASS[width]:
        out.append(f"  %{tag}next = mul i64 %K, {together * width}")  # bytes to the same step one pass ahead
        ahead = f"%{tag}next"
    else:
        ahead = str(prefetch * width * (4 if weights == "int8" else 1))
    out += [f"  br label %{tag}loop", f"{tag}loop:\n  %{tag}k = phi i64 [0, %{tag}start], [%{tag}k_next, %{tag}loop]"]
    out += [f"  %{tag}a{c}_{m} = phi {vec} [zeroinitializer, %{tag}start], [%{tag}s{c}_{m}, %{tag}loop]"
            for c in range(together) for m in range(rows)]
    for c in range(together):
        out += _weight_vector(f"%{tag}{c}", f"%{tag}base{c}", f"%{tag}k", width, ahead, weights)
    out.append(f"  %{tag}xk = mul i64 %{tag}k, %xs\n  %{tag}xrow = getelementptr float, ptr %x, i64 %{tag}xk")
    for m in range(rows):
        x = f"%{tag}x{m}"
        out += [f"  {x}p = getelementptr float, ptr %{tag}xrow, i64 {m}\n  {x}s = load float, ptr {x}p, align 4",
                f"  {x}h = insertelement {vec} poison, float {x}s, i32 0",
                f"  {x} = shufflevector {vec} {x}h, {vec} poison, <{width} x i32> zeroinitializer"]
        out += [f"  %{tag}s{c}_{m} = call {vec} @llvm.fma.v{width}f32({vec} {x}, {vec} %{tag}{c}wv, "
                f"{vec} %{tag}a{c}_{m})" for c in range(together)]
    out.append(f"  %{tag}k_next = add i64 %{tag}k, 1\n  %{tag}last = icmp eq i64 %{tag}k_next, %K")
    out.append(f"  br i1 %{tag}last, label %{tag}store, label %{tag}loop\n{tag}store:")
    out += store_sums(tag, rows, together, width, lambda c: f"%{tag}pb{c}", lambda c, m: f"%{tag}s{c}_{m}")
    out.append(f"  %{tag}b_next = add i64 %{tag}b, {together}\n  br label %{tag}panel")
    return out


def _weight_vector(p: str, base: str, k: str, width: int, ahead: str, weights: str) -> list[str]:
    """IR: `{p}wv`, the panel's weight vector of step k (int8 converted exactly to float), and a prefetch `ahead`
    (an IR operand: elements of the panels' type) further on."""
    vec = f"<{width} x float>"
    out = [f"  {p}step = add i64 {base}, {k}\n  {p}off = mul i64 {p}step, {width}"]
    if weights == "int8":
        out += [f"  {p}wp = getelementptr i8, ptr %w, i64 {p}off\n  {p}wq = load <{width} x i8>, ptr {p}wp, align 1",
                f"  {p}wi = sext <{width} x i8> {p}wq to <{width} x i32>",
                f"  {p}wv = sitofp <{width} x i32> {p}wi to {vec}",
                f"  {p}ahead = getelementptr i8, ptr {p}wp, i64 {ahead}"]
    else:
        out += [f"  {p}wp = getelementptr float, ptr %w, i64 {p}off\n  {p}wv = load {vec}, ptr {p}wp, align 4",
                f"  {p}ahead = getelementptr float, ptr {p}wp, i64 {ahead}"]
    return out + [f"  call void @llvm.prefetch.p0(ptr {p}ahead, i32 0, i32 3, i32 1)"]


def module_ir(width: int, max_rows: int, weights: str = "float32") -> str:
    """The module: one `kernel_ir` (`affine_kernel_ir` for "affine4" / "scaled8") per row count 1..max_rows (for
    panels of `weights`), `transpose`, and
    `streamed_rows(i64 rows, …, i64 lo, i64 hi)`, which computes any number of rows for panels lo ≤ b < hi.
    Up to max_rows rows: one kernel call for all the panels. More rows: panel by panel, the rows in groups of
    max_rows (the last group smaller), so a panel streamed from memory for the first group is read again from the
    core's caches (an AVX2 panel of the default model is 18–48 KB) for the others instead of from memory; measured
    faster than splitting a panel's steps into chunks that every group computes in turn."""
    vec = f"<{width} x float>"
    parts = [f"declare {vec} @llvm.fma.v{width}f32({vec}, {vec}, {vec})",
             "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)"]
    if weights in RECORD_FLOATS:
        parts += [affine_kernel_ir(m, width, name=f"rows{m}", form=weights) for m in range(1, max_rows + 1)]
    else:
        parts += [kernel_ir(m, width, name=f"rows{m}", weights=weights) for m in range(1, max_rows + 1)]
    args = ", ".join(f"i64 %{a}" for a in _ARGS[1:])
    one = "i64 %x, i64 %xs, i64 %w, i64 %y, i64 %k, i64 %n, i64 %lo, i64 %hi"
    group = "i64 %xg, i64 %xs, i64 %w, i64 %yg, i64 %k, i64 %n, i64 %b, i64 %b_next"
    body = [f"define void @streamed_rows(i64 %rows, {args}) {{",
            f"entry:\n  switch i64 %rows, label %groups [ {_cases(max_rows, 'one')} ]"]
    for m in range(1, max_rows + 1):
        body += [f"one{m}:", f"  call void @rows{m}({one})", "  br label %exit"]
    body += ["groups:\n  %several = icmp sgt i64 %rows, 0\n  br i1 %several, label %panel, label %exit",
             "panel:\n  %b = phi i64 [%lo, %groups], [%b_next, %next_group]\n  %done = icmp sge i64 %b, %hi",
             "  %b_next = add i64 %b, 1\n  br i1 %done, label %exit, label %group",
             "group:\n  %r = phi i64 [0, %panel], [%r_next, %next_group]\n  %left = sub i64 %rows, %r",
             f"  %full = icmp sgt i64 %left, {max_rows}\n  %g = select i1 %full, i64 {max_rows}, i64 %left",
             "  %xoff = mul i64 %r, 4\n  %xg = add i64 %x, %xoff",
             "  %yrows = mul i64 %r, %n\n  %yoff = mul i64 %yrows, 4\n  %yg = add i64 %y, %yoff",
             f"  switch i64 %g, label %next_group [ {_cases(max_rows, 'r')} ]"]
    for m in range(1, max_rows + 1):
        body += [f"r{m}:", f"  call void @rows{m}({group})", "  br label %next_group"]
    body += ["next_group:\n  %r_next = add i64 %r, %g\n  %more = icmp slt i64 %r_next, %rows",
             "  br i1 %more, label %group, label %panel",
             "exit:", "  ret void", "}"]
    return "\n".join(parts + body + [TRANSPOSE_IR])


def _cases(max_rows: int, label: str) -> str:
    """An IR switch's cases: row count m → label `{label}{m}` for m = 1..max_rows."""
    return " ".join(f"i64 {m}, label %{label}{m}" for m in range(1, max_rows + 1))


# `transpose(x, xt, M, K)`: xt [K, M] = x [M, K]ᵀ, both float32 (called once per product of several rows, before
# the threads start: a few microseconds, where PyTorch's transposing copy of such small tensors takes ~10–40).
TRANSPOSE_IR = """define void @transpose(i64 %xa, i64 %ta, i64 %M, i64 %K) {
entry:
  %x = inttoptr i64 %xa to ptr
  %t = inttoptr i64 %ta to ptr
  br label %row
row:
  %m = phi i64 [0, %entry], [%m_next, %row_done]
  %src = mul i64 %m, %K
  br label %col
col:
  %k = phi i64 [0, %row], [%k_next, %col]
  %si = add i64 %src, %k
  %sp = getelementptr float, ptr %x, i64 %si
  %v = load float, ptr %sp, align 4
  %dk = mul i64 %k, %M
  %di = add i64 %dk, %m
  %dp = getelementptr float, ptr %t, i64 %di
  store float %v, ptr %dp, align 4
  %k_next = add i64 %k, 1
  %k_end = icmp sge i64 %k_next, %K
  br i1 %k_end, label %row_done, label %col
row_done:
  %m_next = add i64 %m, 1
  %m_end = icmp sge i64 %m_next, %M
  br i1 %m_end, label %exit, label %row
exit:
  ret void
}"""


def scratch_floats(kind: str, rows: int, in_features: int) -> int:
    """Floats of scratch a product of `rows` rows (more than one) on panels of `kind` needs for the call before
    its threads start: x transposed, or the AMX kernel's prepared inputs. At most `product_scratch(rows, K)`."""
    if kind in AMX_KINDS:
        return AMX_KINDS[kind].scratch_floats(rows, in_features)
    return rows * in_features


def prepare_address(kind: str) -> int:
    """The address of the call that prepares a product's rows before its threads start, for panels of `kind`: the
    tile kernel's (`amx_kernel`, `amx_int8`) for its records, else `transpose` (every other module's is the same
    function, so products of different kinds share the float32 module's and a fused layer may mix them)."""
    return AMX_KINDS[kind].addresses()[1] if kind in AMX_KINDS else _kernel_address("float32")[1]


@numba.njit(nogil=True, cache=True)
def product_scratch(rows, in_features):  # pragma: no cover - compiled
    """Floats of scratch that holds any kind's `scratch_floats(kind, rows, in_features)` (compiled code sizes its
    scratch before it knows the kind): x transposed takes rows · K floats, the AMX kernel's pieces and block sums
    fewer than 1.6 · rows · K + 64 · rows + 32."""
    return 2 * rows * in_features + 64 * rows + 32


@functools.cache
def _kernel_address(weights: str = "float32") -> tuple[int, int]:
    """Addresses of the compiled `streamed_rows` dispatcher and of `transpose` for panels of `weights` ("float32",
    "int8", "affine4", "affine4h", "scaled8", or "amx4" / "amx8": the tile kernels' modules; each compiled on first
    use, ~0.15 s, or loaded from the disk cache, ~3 ms: `compiled_ir`)."""
    if weights in AMX_KINDS:
        return AMX_KINDS[weights].addresses()
    if weights not in ("float32", "int8", *RECORD_FLOATS):
        raise ValueError(f"streamed_gemm computes float32, int8, affine4, affine4h, scaled8, amx4 or amx8 panels, "
                         f"got {weights}")
    ir = module_ir(vector_width(), rows_per_pass(), weights)
    return compiled_addresses(ir, ("streamed_rows", "transpose"), f"streamed-{weights}-{vector_width()}")


@intrinsic
def _call_address(typingctx, address, rows, x, xs, w, y, k, n, lo, hi):
    """Call the compiled dispatcher at `address` with nine i64 arguments (numba has no call-by-address)."""
    return nb_types.void(*([nb_types.int64] * 10)), call_codegen(9)


@intrinsic
def _call_transpose(typingctx, address, x, xt, rows, k):
    """Call the compiled `transpose` at `address` with four i64 arguments."""
    return nb_types.void(*([nb_types.int64] * 5)), call_codegen(4)


@numba.njit(parallel=True, nogil=True, cache=True)
def _launch_groups(address, transpose, rows, x, xt, w, y, k, n, blocks, threads, group_bytes):
    # pragma: no cover - compiled
    """`_launch` for a tile kernel's many rows: the threads prepare the groups of 16 rows a contiguous range each
    (`_prepare_groups`), then compute their panels."""
    _prepare_groups(transpose, rows, x, xt, k, threads, group_bytes)
    for t in numba.prange(threads):
        _call_address(address, rows, xt, rows, w, y, k, n, t * blocks // threads, (t + 1) * blocks // threads)


@numba.njit(parallel=True, nogil=True, cache=True)
def _prepare_groups(transpose, rows, x, xt, k, threads, group_bytes):  # pragma: no cover - compiled
    """The bytes `transpose` writes for x [rows, k] at xt, written by `threads` threads, each a contiguous range of
    the groups of 16 rows (`group_bytes` of the scratch each, `amx_kernel.group_bytes`). A function of its own: in
    the caller, numba would fuse this loop with the kernel's, and a thread would compute before the other's rows
    are prepared."""
    size = _TILE_GROUP
    groups = (rows + size - 1) // size
    base = (xt + 63) // 64 * 64  # where `transpose` puts the first group
    for t in numba.prange(threads):
        first, last = t * groups // threads, (t + 1) * groups // threads
        if last > first:
            count = min(rows, last * size) - first * size
            _call_transpose(transpose, x + first * size * k * 4, base + first * group_bytes, count, k)


@numba.njit(parallel=True, nogil=True, cache=True)
def _launch(address, transpose, rows, x, xt, w, y, k, n, blocks, threads):  # pragma: no cover - compiled
    """Transpose x [rows, k] into xt [k, rows] (several rows; one row is its own transpose, `xt` is then x), split
    the panels into `threads` contiguous ranges and run the kernel on each in parallel."""
    if rows > 1:
        _call_transpose(transpose, x, xt, rows, k)
    for t in numba.prange(threads):
        _call_address(address, rows, xt, rows, w, y, k, n, t * blocks // threads, (t + 1) * blocks // threads)
