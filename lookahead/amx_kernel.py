"""The AMX kernel: products of 4-bit block weights on Intel's tile units, where a row costs little beyond the first.

The streamed kernel (`affine_kernel`) issues one float32 multiply-add per weight and row, so on the Intel machine
of sessions 50–53 each row of a step cost ~1 ms more (2 / 8 / 16 rows: 1.18x / 2.26x / 3.96x a one-row step). A
tile multiply-add (`tdpbf16ps`, AMX-BF16) computes 16 rows × 16 columns × 32 steps at once, so the rows come
nearly free. The arithmetic stays float32-accurate:

- a weight `fma(q, d, m)` of a 4-bit block (`affine_weights`: d and m float16, q 0…15) enters the tile as the
  bfloat16 `1 + q/16` (exact: four bits of mantissa; made from the codes by a shift and two bit operations per 32
  weights), so a block's tile sums C = Σ (1 + q/16)·x over its 32 steps, and the row's sum gains
  `16d·C + (m - 16d)·S` with S = Σ x over the block (float32);
- each input x is split into three bfloat16 pieces, x1 = x rounded, x2 = (x - x1) rounded, x3 = (x - x1 - x2)
  rounded, whose sum is x exactly (below float32's normal range, ~1e-38, values flush to zero); three tile
  multiply-adds per block take one piece each. Every product of a piece and a code is exact, so the error is
  the float32 sums' rounding: relative to float64, 6.6e-7–1.7e-6 on the default model's first layer's products
  at 1–16 rows, the streamed kernel's 9.5e-7–1.5e-6 (`benchmarks/bench_amx_kernel.py`);
- a row's sums do not depend on the rows computed with it or on the split between threads (each tile row is its
  own sums, in the same order), as the streamed kernel's do not — but they are not the streamed kernel's bits.

Layout ("amx4" records, `records`): per panel of 16 columns and block of 32 steps, 320 bytes: the columns' (d, m)
as float16 halves of a 32-bit word, then the codes as four vectors of 32 words, word (column n, pair p) of vector j
holding the codes of steps 2(4j + s) + p at bits 4s (s = 0…3), so shifting a vector and masking gives one tile row
of bfloat16 pairs. Records past the last are zero (the kernel widens codes ahead).

The kernel (one per row count 1…16; more rows in groups of 16) keeps a ring of four code tiles, widened three
blocks ahead of the tile load that reads them (a tile load of bytes just stored stalls: one block ahead took twice
as long), alternates two tile sets between blocks and scales a block's sums one block later. Its inputs are
prepared once per product, before the threads start (`transpose`, the contract of `streamed_gemm`'s transpose:
the pieces and block sums of every row, into the caller's scratch of `scratch_floats` floats); a lone row (which
the callers pass without that call) is prepared by each thread on its stack.

Kernel-level, 2 threads, the default model's 120 layer products streamed from memory, rows prepared or transposed
inside the timing (ms for all of them, AMX / streamed kernel, `python benchmarks/bench_amx_kernel.py`, session 53):
1 row 4.41 / 4.46, 2 rows 4.98 / 5.66, 4 rows 5.94 / 6.85, 8 rows 7.62 / 10.58, 16 rows 12.39 / 18.04.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .affine_kernel import widen_halves
from .compiled_ir import compiled_addresses, host_features
from .vector_ir import splat, splat_const

KIND = "amx4"
GROUP = 16  # rows of one tile
PIECES, RING, AHEAD, PREFETCH = 3, 4, 3, 2048  # x pieces, code tiles in the ring, blocks widened ahead, bytes
RECORD = 320  # bytes of a block of 16 columns × 32 steps
TILE_BYTES = 1024
SCRATCH = 64 + (RING + 2) * TILE_BYTES  # a kernel's stack area: tile configuration, code tiles, two blocks' sums
FEATURES = ("+amx-tile", "+amx-bf16", "+avx512bf16", "+avx512bw", "+avx512f")
V16F, V16I, V32S = "<16 x float>", "<16 x i32>", "<32 x i16>"
_ARCH_PRCTL, _REQ_XCOMP_PERM, _XTILEDATA = 158, 0x1023, 18


@functools.cache
def available() -> bool:
    """Whether this process can run the kernel: the CPU has AMX-BF16 tiles and AVX-512 (as llvmlite reports its
    features) and Linux grants the process AMX tile data (asked once, `arch_prctl`)."""
    features = host_features().split(",")
    if not all(feature in features for feature in FEATURES):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(_ARCH_PRCTL, _REQ_XCOMP_PERM, _XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def fits(in_features: int) -> bool:
    """Whether the kernel computes products of this width: whole pairs of blocks (K a multiple of 64)."""
    return in_features > 0 and in_features % 64 == 0


def records(scales: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N_pad / 16, K / 32, RECORD] "amx4" records (module docstring) of a weight in 4-bit block form (scales,
    offsets [N, K/32] float16-exact, codes [N, K] 0…15); padding columns are zero, and AHEAD + 1 zero records follow
    the last in the tensor's storage (it is a view of a larger buffer, 64-byte aligned as torch allocates)."""
    n, k = codes.shape
    panels, blocks = -(-n // GROUP), k // 32
    storage = torch.zeros(panels * blocks + AHEAD + 1, RECORD, dtype=torch.uint8)
    body = storage[:panels * blocks].view(panels, blocks, RECORD)
    words = torch.zeros(panels * GROUP, blocks, dtype=torch.int32)
    words[:n] = (scales.half().view(torch.int16).to(torch.int32) & 0xFFFF) | (
        offsets.half().view(torch.int16).to(torch.int32) << 16)
    body[:, :, :64] = words.view(panels, GROUP, blocks).permute(0, 2, 1).contiguous().view(torch.uint8).view(
        panels, blocks, 64)
    steps = torch.zeros(panels * GROUP, k, dtype=torch.int32)
    steps[:n] = codes.to(torch.int32)
    steps = steps.view(panels, GROUP, blocks, 4, 4, 2)  # panel, column, block, vector j, shift s, pair p
    packed = sum(steps[:, :, :, :, s, :] << (4 * s) for s in range(4))  # panel, column, block, j, p
    body[:, :, 64:] = packed.permute(0, 2, 3, 1, 4).to(torch.int16).contiguous().view(torch.uint8).view(
        panels, blocks, 256)
    return body


def scratch_floats(rows: int, in_features: int, region_bytes=None) -> int:
    """Floats of scratch `transpose` needs for `rows` rows of width `in_features`: every group's pieces and block
    sums, 64-byte aligned. `region_bytes(rows, in_features)`: a group's bytes (None: this module's)."""
    region_bytes = _region_bytes if region_bytes is None else region_bytes
    full, left = divmod(rows, GROUP)
    groups = [GROUP] * full + ([left] if left else [])
    return (64 + sum(region_bytes(size, in_features) for size in groups)) // 4


def group_bytes(in_features: int, region_bytes=None) -> int:
    """Bytes of one whole group's (GROUP rows') prepared inputs in the scratch, a multiple of 64: group g's start
    `transpose` lays out g of them after the scratch's first 64-byte boundary. `region_bytes` as `scratch_floats`."""
    return (_region_bytes if region_bytes is None else region_bytes)(GROUP, in_features)


def _region_bytes(rows: int, in_features: int) -> int:
    """Bytes of one group's prepared inputs: its pieces [K/32 + 1, PIECES, rows, 32] bfloat16 (a zero block last),
    then its block sums [K/32, rows] float32, rounded up to 64."""
    blocks = in_features // 32
    return ((blocks + 1) * PIECES * rows * 64 + blocks * rows * 4 + 63) // 64 * 64


@functools.cache
def addresses() -> tuple[int, int]:
    """(address of `streamed_rows`, address of `transpose`) of the compiled module (`compiled_ir`'s disk cache).
    Raises `RuntimeError` where the kernel cannot run (`available`: this also asks Linux for the tiles, without
    which the first tile instruction kills the process)."""
    if not available():
        raise RuntimeError("the AMX kernel needs a CPU with AMX-BF16 and AVX-512, and Linux granting AMX tile data")
    return compiled_addresses(module_ir(), ("streamed_rows", "transpose"), "amx4")


def module_ir() -> str:
    """The module: `prepare`, the kernels `rows1` … `rows16`, `single` (a lone row), `streamed_rows` (the
    dispatcher, `streamed_gemm`'s contract) and `transpose` (prepares several rows)."""
    declarations = [f"declare {V16F} @llvm.fma.v16f32({V16F}, {V16F}, {V16F})",
                    "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)"]
    kernels = ["\n".join(kernel_ir(rows)) for rows in range(1, GROUP + 1)]
    return "\n".join(declarations + [_prepare_ir()] + kernels + driver_ir())


def driver_ir(region=None) -> list[str]:
    """IR of `single`, `streamed_rows` and `transpose` around a module's `prepare` and kernels `rows1` … `rows16`;
    `region(rows, tag)`: IR computing `%{tag}region`, the bytes of a group's prepared inputs (None: this module's
    `_region_ir`). `amx_int8` shares them with its own region."""
    region = _region_ir if region is None else region
    return [_single_ir(region), _dispatcher_ir(region), _transpose_ir(region)]


def _halving_sum() -> list[str]:
    """IR of `%s1`, a block's sum: its halves `%lo_r0` + `%hi_r0` lane by lane, then the vector's halves added four
    times (16 → 8 → 4 → 2 → 1 lanes)."""
    out, name, lanes = ["  %s16 = fadd <16 x float> %lo_r0, %hi_r0"], "%s16", 16
    while lanes > 1:
        half = lanes // 2
        parts = []
        for side, first in (("a", 0), ("b", half)):
            part = f"%s{lanes}{side}"
            if half == 1:
                out.append(f"  {part} = extractelement <{lanes} x float> {name}, i32 {first}")
            else:
                mask = ", ".join(f"i32 {i}" for i in range(first, first + half))
                out.append(f"  {part} = shufflevector <{lanes} x float> {name}, <{lanes} x float> poison, "
                           f"<{half} x i32> <{mask}>")
            parts.append(part)
        kind = "float" if half == 1 else f"<{half} x float>"
        out.append(f"  %s{half} = fadd {kind} {parts[0]}, {parts[1]}")
        name, lanes = f"%s{half}", half
    return out


def _prepare_ir() -> str:
    """IR of `prepare(x, dest, M, K)`: the pieces and block sums of rows x [M, K] (float32, row-major) into dest
    (64-byte aligned, `_region_bytes(M, K)` bytes), then each row's zero block."""
    head = ["define internal void @prepare(ptr %x, ptr %dest, i64 %M, i64 %K) {", "entry:",
            "  %blocks = udiv i64 %K, 32", "  %b1 = add i64 %blocks, 1", "  %pr = mul i64 %b1, %M",
            f"  %pieces_bytes = mul i64 %pr, {PIECES * 64}", "  %sums = getelementptr i8, ptr %dest, i64 %pieces_bytes",
            "  br label %row", "row:", "  %m = phi i64 [0, %entry], [%m_next, %row_end]", "  br label %block",
            "block:", "  %b = phi i64 [0, %row], [%b_next, %block]", "  %k0 = mul i64 %b, 32", "  %mk = mul i64 %m, %K",
            "  %src = add i64 %mk, %k0", "  %lo_p = getelementptr float, ptr %x, i64 %src",
            "  %hi_p = getelementptr float, ptr %lo_p, i64 16", "  %lo_r0 = load <16 x float>, ptr %lo_p, align 4",
            "  %hi_r0 = load <16 x float>, ptr %hi_p, align 4", f"  %bp = mul i64 %b, {PIECES}",
            "  %bpm = mul i64 %bp, %M", "  %slot0 = add i64 %bpm, %m"]
    body = [line for i in range(PIECES) for line in _piece_ir(i)]
    tail = [*_halving_sum(), "  %bm = mul i64 %b, %M", "  %si = add i64 %bm, %m",
            "  %sp = getelementptr float, ptr %sums, i64 %si", "  store float %s1, ptr %sp, align 4",
            "  %b_next = add i64 %b, 1", "  %b_end = icmp eq i64 %b_next, %blocks",
            "  br i1 %b_end, label %row_end, label %block", "row_end:", f"  %zb = mul i64 %blocks, {PIECES}",
            "  %zbm = mul i64 %zb, %M", "  %zs = add i64 %zbm, %m"]
    for i in range(PIECES):
        tail += [f"  %z{i}m = mul i64 %M, {i}", f"  %z{i}s = add i64 %zs, %z{i}m", f"  %z{i}o = mul i64 %z{i}s, 64",
                 f"  %z{i}p = getelementptr i8, ptr %dest, i64 %z{i}o",
                 f"  store <16 x float> zeroinitializer, ptr %z{i}p, align 64"]
    tail += ["  %m_next = add i64 %m, 1", "  %m_end = icmp eq i64 %m_next, %M",
             "  br i1 %m_end, label %exit, label %row", "exit:", "  ret void", "}"]
    return "\n".join(head + body + tail)


def _piece_ir(i: int) -> list[str]:
    """IR of piece i of a block's two halves: the residuals `%lo_r{i}` / `%hi_r{i}` rounded to bfloat16 and stored
    at the piece's slot, their rounding errors `%lo_r{i+1}` / `%hi_r{i+1}` left for the next piece."""
    out = []
    for half in ("lo", "hi"):
        out += [f"  %{half}{i} = fptrunc <16 x float> %{half}_r{i} to <16 x bfloat>",
                f"  %{half}_w{i} = fpext <16 x bfloat> %{half}{i} to <16 x float>",
                f"  %{half}_r{i + 1} = fsub <16 x float> %{half}_r{i}, %{half}_w{i}"]
    return out + [f"  %slot{i}m = mul i64 %M, {i}", f"  %slot{i}s = add i64 %slot0, %slot{i}m",
                  f"  %off{i} = mul i64 %slot{i}s, 64", f"  %dst{i} = getelementptr i8, ptr %dest, i64 %off{i}",
                  f"  store <16 x bfloat> %lo{i}, ptr %dst{i}, align 32",
                  f"  %dsth{i} = getelementptr i8, ptr %dst{i}, i64 32",
                  f"  store <16 x bfloat> %hi{i}, ptr %dsth{i}, align 32"]


def _region_ir(rows: str, tag: str) -> list[str]:
    """IR computing `%{tag}region` = `_region_bytes(rows, %K)` (rows an IR value)."""
    return [f"  %{tag}blocks = udiv i64 %K, 32", f"  %{tag}b1 = add i64 %{tag}blocks, 1",
            f"  %{tag}p = mul i64 %{tag}b1, {rows}", f"  %{tag}pb = mul i64 %{tag}p, {PIECES * 64}",
            f"  %{tag}s = mul i64 %{tag}blocks, {rows}", f"  %{tag}sb = mul i64 %{tag}s, 4",
            f"  %{tag}t = add i64 %{tag}pb, %{tag}sb", f"  %{tag}t63 = add i64 %{tag}t, 63",
            f"  %{tag}region = and i64 %{tag}t63, -64"]


def _single_ir(region) -> str:
    """`single(x, w, y, K, N, lo, hi)`: one row, x [K] itself; prepared on this thread's stack, then `rows1`."""
    return "\n".join(["define internal void @single(i64 %x, i64 %w, i64 %y, i64 %K, i64 %N, i64 %lo, i64 %hi) {",
                      "entry:", *region("1", "r"), "  %area = alloca i8, i64 %rregion, align 64",
                      "  %xp = inttoptr i64 %x to ptr", "  call void @prepare(ptr %xp, ptr %area, i64 1, i64 %K)",
                      "  %ai = ptrtoint ptr %area to i64",
                      "  call void @rows1(i64 %ai, i64 %w, i64 %y, i64 %K, i64 %N, i64 %lo, i64 %hi)",
                      "  ret void", "}"])


def _groups_loop(enter: str, body: list[str], latch: str, tag: str, region) -> list[str]:
    """IR looping over the groups of 16 rows, entered from block `enter`: `%r` a group's first row, `%g` its size,
    `%at` its prepared region (from `%xt` rounded up to 64 bytes); `body` runs from block `group` and ends in
    block `latch`, which moves on to the next group."""
    return ["  %base63 = add i64 %xt, 63", "  %base = and i64 %base63, -64", "  br label %group",
            "group:", f"  %r = phi i64 [0, %{enter}], [%r_next, %{latch}]",
            f"  %at = phi i64 [%base, %{enter}], [%at_next, %{latch}]",
            "  %left = sub i64 %rows, %r", f"  %full = icmp sgt i64 %left, {GROUP}",
            f"  %g = select i1 %full, i64 {GROUP}, i64 %left", *body, *region("%g", tag),
            f"  %at_next = add i64 %at, %{tag}region", f"  %r_next = add i64 %r, {GROUP}",
            "  %more = icmp slt i64 %r_next, %rows", "  br i1 %more, label %group, label %exit",
            "exit:", "  ret void", "}"]


def _dispatcher_ir(region) -> str:
    """`streamed_rows(rows, x, xs, w, y, K, N, lo, hi)`: one row from x itself (`single`); more from the regions
    `transpose` prepared at x, group by group, each over panels lo ≤ b < hi."""
    cases = " ".join(f"i64 {m}, label %r{m}" for m in range(1, GROUP + 1))
    head = ["define void @streamed_rows(i64 %rows, i64 %xt, i64 %xs, i64 %w, i64 %y, i64 %K, i64 %N, i64 %lo, "
            "i64 %hi) {", "entry:", "  %one = icmp eq i64 %rows, 1", "  br i1 %one, label %lone, label %start",
            "lone:", "  call void @single(i64 %xt, i64 %w, i64 %y, i64 %K, i64 %N, i64 %lo, i64 %hi)",
            "  ret void", "start:"]
    body = ["  %yrows = mul i64 %r, %N", "  %yoff = mul i64 %yrows, 4", "  %yg = add i64 %y, %yoff",
            f"  switch i64 %g, label %done [ {cases} ]"]
    for m in range(1, GROUP + 1):
        body += [f"r{m}:", f"  call void @rows{m}(i64 %at, i64 %w, i64 %yg, i64 %K, i64 %N, i64 %lo, i64 %hi)",
                 "  br label %done"]
    return "\n".join(head + _groups_loop("start", body + ["done:"], "done", "n", region))


def _transpose_ir(region) -> str:
    """`transpose(x, xt, M, K)` (`streamed_gemm`'s name and contract for the call before the threads start): the
    pieces and block sums of x [M, K] into the scratch at xt (`scratch_floats(M, K)` floats), group by group."""
    body = ["  %xrow = mul i64 %r, %K", "  %xoff = mul i64 %xrow, 4", "  %xg = add i64 %x, %xoff",
            "  %xgp = inttoptr i64 %xg to ptr", "  %atp = inttoptr i64 %at to ptr",
            "  call void @prepare(ptr %xgp, ptr %atp, i64 %g, i64 %K)"]
    return "\n".join(["define void @transpose(i64 %x, i64 %xt, i64 %rows, i64 %K) {", "entry:",
                      *_groups_loop("entry", body, "group", "t", region)])


def kernel_ir(rows: int) -> list[str]:
    """IR of `rows{rows}(i64 x, i64 w, i64 y, i64 K, i64 N, i64 lo, i64 hi)`: x the rows' prepared region, y
    [rows, N]; per panel lo ≤ b < hi, block 0's tiles, then blocks in pairs (tiles of the next block, scaling of
    the one before), the sums stored to y."""
    setup = ["  %bufs = getelementptr i8, ptr %cfg, i64 64",
             f"  %sums = getelementptr i8, ptr %cfg, i64 {64 + RING * TILE_BYTES}",
             "  %b1 = add i64 %blocks, 1", "  %pr = mul i64 %b1, " + str(PIECES * rows * 64),
             "  %s = getelementptr i8, ptr %x, i64 %pr"]
    body = ["  %first_bytes = mul i64 %first, " + str(RECORD),
            "  %first_record = getelementptr i8, ptr %w, i64 %first_bytes"]
    for ahead in range(AHEAD):
        body += [f"  %pre{ahead}r = getelementptr i8, ptr %first_record, i64 {RECORD * ahead}",
                 f"  %pre{ahead}b = getelementptr i8, ptr %bufs, i64 {TILE_BYTES * ahead}"]
        body += widen(f"%pre{ahead}r", f"%pre{ahead}b", f"pre{ahead}")
    return kernel_shell(rows, SCRATCH, _tile_config(rows), setup, body + block_pairs(rows, tiles, scale))


def kernel_shell(rows: int, scratch: int, config: str, setup: list[str], body: list[str]) -> list[str]:
    """IR of `rows{rows}(i64 x, i64 w, i64 y, i64 K, i64 N, i64 lo, i64 hi)` around a tile kernel's own parts: x, w
    and y as pointers, `%blocks` = K / 32, a stack area `%cfg` of `scratch` bytes starting with the tile
    configuration `config` (an IR constant), then `setup`, the tiles configured; per panel lo ≤ b < hi (`%b`,
    `%first` = b · blocks) `body` runs from block `start` and branches to block `store` with the rows' sums in
    `%odd0` … , which stores them to y [rows, N]. `amx_int8` builds its kernels on it too."""
    out = [f"define internal void @rows{rows}(i64 %xa, i64 %wa, i64 %ya, i64 %K, i64 %N, i64 %lo, i64 %hi) {{",
           "entry:", "  %x = inttoptr i64 %xa to ptr", "  %w = inttoptr i64 %wa to ptr",
           "  %y = inttoptr i64 %ya to ptr", f"  %cfg = alloca i8, i64 {scratch}, align 64",
           f"  store <64 x i8> {config}, ptr %cfg, align 64", "  %blocks = udiv i64 %K, 32", *setup,
           '  call void asm sideeffect "ldtilecfg ($0)", "r,~{memory}"(ptr %cfg)', "  br label %panel",
           "panel:", "  %b = phi i64 [%lo, %entry], [%b_next, %store]", "  %done = icmp sge i64 %b, %hi",
           "  br i1 %done, label %exit, label %start", "start:", "  %first = mul i64 %b, %blocks", *body,
           "store:", f"  %col = mul i64 %b, {GROUP}"]
    for m in range(rows):
        out += [f"  %yr{m} = mul i64 %N, {m}", f"  %yi{m} = add i64 %yr{m}, %col",
                f"  %yp{m} = getelementptr float, ptr %y, i64 %yi{m}", f"  store {V16F} %odd{m}, ptr %yp{m}, align 4"]
    return out + ["  %b_next = add i64 %b, 1", "  br label %panel", "exit:",
                  '  call void asm sideeffect "tilerelease", "~{memory}"()', "  ret void", "}"]


def block_pairs(rows: int, tiles, scale, guarded: bool = False) -> list[str]:
    """IR of a panel's blocks from block 0's tiles on, in pairs: the tiles of the next block (set 1), the scaling
    of the one before (set 0), the tiles of the one after (set 0), the scaling of the next (set 1), each row's sums
    in `%acc{m}` → `%even{m}` → `%odd{m}`; then a branch to `store` after the last. `tiles(rows, parity, block,
    tag)` and `scale(rows, block, parity, tag, before, after)` are the kernel's; `guarded`: no tiles for the block
    past the last (else the kernel's records and rows must let it read one)."""
    latch = "join" if guarded else "block"
    out = [*tiles(rows, 0, "0", "first"), "  br label %block", "block:",
           f"  %r = phi i64 [0, %start], [%r_next, %{latch}]"]
    out += [f"  %acc{m} = phi {V16F} [zeroinitializer, %start], [%odd{m}, %{latch}]" for m in range(rows)]
    out += ["  %r1 = add i64 %r, 1", "  %r2 = add i64 %r, 2", *tiles(rows, 1, "%r1", "O"),
            *scale(rows, "%r", 0, "SE", lambda m: f"%acc{m}", lambda m: f"%even{m}")]
    if guarded:
        out += ["  %more = icmp ult i64 %r2, %blocks", "  br i1 %more, label %ahead, label %join", "ahead:"]
    out += tiles(rows, 0, "%r2", "E")
    out += ["  br label %join", "join:"] if guarded else []
    out += scale(rows, "%r1", 1, "SO", lambda m: f"%even{m}", lambda m: f"%odd{m}")
    return out + ["  %r_next = add i64 %r, 2", "  %last = icmp uge i64 %r_next, %blocks",
                  "  br i1 %last, label %store, label %block"]


def _tile_config(rows: int) -> str:
    """The 64-byte tile configuration as an IR constant: palette 1; tiles 0–2 (x pieces) and 4, 5 (sums) `rows`
    rows, tiles 3 and 6 (codes) 16 rows; every tile 64 bytes wide."""
    data = [0] * 64
    data[0] = 1
    for tile in range(8):
        data[16 + 2 * tile] = 64
        data[48 + tile] = 16 if tile in (3, 6) else rows
    return "<" + ", ".join(f"i8 {value}" for value in data) + ">"


def widen(record: str, buffer: str, tag: str) -> list[str]:
    """IR writing the codes of the record at `record` as a tile of bfloat16 pairs (1 + q/16) at `buffer`."""
    out = []
    for j in range(4):
        out += [f"  %{tag}c{j}p = getelementptr i8, ptr {record}, i64 {64 + 64 * j}",
                f"  %{tag}c{j} = load {V32S}, ptr %{tag}c{j}p, align 64"]
        for s, (shift, bits) in enumerate([("shl", 3), ("lshr", 1), ("lshr", 5), ("lshr", 9)]):
            t = f"%{tag}w{j}_{s}"
            out += [f"  {t}a = {shift} {V32S} %{tag}c{j}, {splat_const(bits, 32, 'i16')}",
                    f"  {t}b = and {V32S} {t}a, {splat_const(0x78, 32, 'i16')}",
                    f"  {t} = or {V32S} {t}b, {splat_const(0x3F80, 32, 'i16')}",
                    f"  {t}p = getelementptr i8, ptr {buffer}, i64 {64 * (4 * j + s)}",
                    f"  store {V32S} {t}, ptr {t}p, align 64"]
    return out


def record_address(block: str, tag: str, record: int = RECORD) -> list[str]:
    """IR of `%{tag}rp`, the address of the current panel's record of block `block` (an IR value or constant),
    records of `record` bytes."""
    return [f"  %{tag}i = add i64 %first, {block}", f"  %{tag}o = mul i64 %{tag}i, {record}",
            f"  %{tag}rp = getelementptr i8, ptr %w, i64 %{tag}o"]


def tiles(rows: int, parity: int, block: str, tag: str) -> list[str]:
    """IR of block `block`'s tile work (tile set `parity`): load its code tile from the ring, zero the sums, one
    multiply-add per x piece, store the sums to their buffer; then widen block + AHEAD into the ring."""
    t = tag
    out = [*record_address(block, t), f"  %{t}xo = mul i64 {block}, {PIECES * rows * 64}",
           f"  %{t}xp = getelementptr i8, ptr %x, i64 %{t}xo",
           f"  %{t}slot = urem i64 {block}, {RING}", f"  %{t}so = mul i64 %{t}slot, {TILE_BYTES}",
           f"  %{t}buf = getelementptr i8, ptr %bufs, i64 %{t}so",
           f"  %{t}ai = add i64 {block}, {AHEAD}", f"  %{t}aslot = urem i64 %{t}ai, {RING}",
           f"  %{t}aso = mul i64 %{t}aslot, {TILE_BYTES}", f"  %{t}abuf = getelementptr i8, ptr %bufs, i64 %{t}aso",
           f"  %{t}arp = getelementptr i8, ptr %{t}rp, i64 {RECORD * AHEAD}",
           f"  %{t}cbp = getelementptr i8, ptr %sums, i64 {parity * TILE_BYTES}"]
    for line in range(0, RECORD, 64):
        out += [f"  %{t}pf{line} = getelementptr i8, ptr %{t}rp, i64 {PREFETCH + line}",
                f"  call void @llvm.prefetch.p0(ptr %{t}pf{line}, i32 0, i32 3, i32 1)"]
    codes, total = (3, 4) if parity == 0 else (6, 5)
    asm = ["movq $$64, %r11", f"tileloadd ($0,%r11,1), %tmm{codes}", f"tilezero %tmm{total}"]
    for i in range(PIECES):
        asm += [f"tileloadd {i * rows * 64}($1,%r11,1), %tmm{i}", f"tdpbf16ps %tmm{codes}, %tmm{i}, %tmm{total}"]
    asm.append(f"tilestored %tmm{total}, ($2,%r11,1)")
    out.append('  call void asm sideeffect "' + "\\0A".join(asm)
               + f'", "r,r,r,~{{r11}},~{{memory}}"(ptr %{t}buf, ptr %{t}xp, ptr %{t}cbp)')
    return out + widen(f"%{t}arp", f"%{t}abuf", f"{t}x")


def scale(rows: int, block: str, parity: int, tag: str, before, after) -> list[str]:
    """IR adding block `block`'s sums C (buffer `parity`) to each row's accumulator: 16d·C + (m - 16d)·S."""
    t = tag
    out = [*record_address(block, t), f"  %{t}cb = getelementptr i8, ptr %sums, i64 {parity * TILE_BYTES}",
           f"  %{t}dm = load {V16I}, ptr %{t}rp, align 64", *widen_halves(f"%{t}", 16),
           f"  %{t}d16 = fmul {V16F} %{t}d, {splat_const('16.0', 16)}",
           f"  %{t}e = call {V16F} @llvm.fma.v16f32({V16F} %{t}d16, {V16F} {splat_const('-1.0', 16)}, "
           f"{V16F} %{t}m)",
           f"  %{t}sb = mul i64 {block}, {rows}"]
    for m in range(rows):
        out += [f"  %{t}pp{m} = getelementptr i8, ptr %{t}cb, i64 {64 * m}",
                f"  %{t}p{m} = load {V16F}, ptr %{t}pp{m}, align 64",
                f"  %{t}si{m} = add i64 %{t}sb, {m}", f"  %{t}sp{m} = getelementptr float, ptr %s, i64 %{t}si{m}",
                f"  %{t}ss{m} = load float, ptr %{t}sp{m}", *splat(f"{t}sv{m}", f"%{t}ss{m}", 16),
                f"  %{t}t{m} = call {V16F} @llvm.fma.v16f32({V16F} %{t}d16, {V16F} %{t}p{m}, {V16F} {before(m)})",
                f"  {after(m)} = call {V16F} @llvm.fma.v16f32({V16F} %{t}e, {V16F} %{t}sv{m}, {V16F} %{t}t{m})"]
    return out
