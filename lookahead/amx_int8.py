"""The AMX-INT8 kernel: products of 8-bit block weights (GGUF's Q8_0, `d · q`) on Intel's tile units.

The streamed kernel computes an 8-bit weight ("scaled8", the default model's LM head) with one float32 multiply-add
per weight and row, so each row of a step costs ~0.2 ms more on the head alone (1 / 2 / 4 / 8 / 16 rows: 0.91 /
1.20 / 1.47 / 2.28 / 3.85 ms on the Intel machine of session 54). Bfloat16 tiles (`amx_kernel`) made rows nearly
free but needed every 8-bit code widened to bfloat16, which cost more than the product (session 54). An int8 tile
multiply-add (`tdpbssd`) takes the codes as they are stored: C[r, n] += Σ_k A[r, k] · B[k, n] over int8 A and B,
exact int32 sums. The rows enter as int8 pieces, so the arithmetic stays float32-accurate:

- a row's block of 32 inputs x is scaled by a power of two s (from the block's largest |x|, so that |x / s| < 64)
  and split into four int8 pieces a_p = rint of what the pieces before left, times 128 each time:
  x = s · (a_0 + a_1 / 2⁷ + a_2 / 2¹⁴ + a_3 / 2²¹) + e, every step exact in float32 and |e| ≤ s / 2²², about
  2⁻²⁷ of the block's largest input (the inputs within an eighth of it are exact);
- the pieces of up to four rows fill the sixteen rows of an A tile, so one multiply-add per block of 32 steps gives
  every piece's exact int32 sums C_p, and the row's sum gains d · s · (C_0 + C_1 / 2⁷ + C_2 / 2¹⁴ + C_3 / 2²¹)
  (float32, Horner from the smallest piece) — four conversions and multiply-adds per row and block of 32 weights
  instead of 32;
- a row's sums depend only on its own pieces, in an order fixed by K: the same bits whatever rows or threads
  compute it with (tested); not the streamed kernel's bits.

Layout ("amx8" records, `records`): per panel of 16 columns and block of 32 steps, 576 bytes (as "scaled8"'s 1.125
bytes a weight): the columns' scales d as float32, then the codes as one B tile of 8 rows of 64 bytes, row r
holding steps 4r … 4r + 3 of each column side by side (the layout `tdpbssd` reads).

The kernel (one per row count 1…16; more rows in groups of 16) loads each block's B tile straight from the record,
multiplies it with the A tile(s) of the rows' pieces into int32 sums stored to the stack, and scales a block's sums
one block later, two tile sets alternating between blocks. The rows' pieces are prepared once per product before
the threads start (`transpose`, `streamed_gemm`'s contract); a lone row is prepared by each thread on its stack.
"""

from __future__ import annotations

import functools

import torch

from . import amx_kernel
from .compiled_ir import compiled_addresses, host_features
from .vector_ir import splat, splat_const

KIND = "amx8"
GROUP = amx_kernel.GROUP  # rows a kernel computes at most (a dispatcher's group: `amx_kernel.driver_ir`)
PIECES = 4  # int8 pieces of an input
TILE_ROWS = 16 // PIECES  # rows whose pieces share an A tile
RECORD = 576  # bytes of a block of 16 columns × 32 steps
PIECE_BYTES = 32  # one piece of one row's block
SLACK = (TILE_ROWS - 1) * PIECES * PIECE_BYTES  # bytes past a group's last block that its last A tile may read
SUMS = 4 * 1024  # bytes of one block's int32 sums on the stack (up to 4 tiles of 16 rows × 64 bytes)
SCRATCH = 64 + 2 * SUMS  # the kernel's stack area: tile configuration, two blocks' sums
FEATURES = ("+amx-tile", "+amx-int8", "+avx512bw", "+avx512f")
V16F, V16I = "<16 x float>", "<16 x i32>"
STEP = "0x3F80000000000000"  # 2⁻⁷ as an IR float literal


def available() -> bool:
    """Whether this process can run the kernel: AMX-INT8 tiles and AVX-512 (llvmlite's host features) and Linux
    granting the process AMX tile data (`amx_kernel.available` asks for it)."""
    return _has_features() and amx_kernel.available()


@functools.cache
def _has_features() -> bool:
    """Whether the host CPU has every feature of FEATURES (llvmlite's host features)."""
    features = host_features().split(",")
    return all(feature in features for feature in FEATURES)


def fits(in_features: int) -> bool:
    """Whether the kernel computes products of this width: whole pairs of blocks (K a multiple of 64)."""
    return in_features > 0 and in_features % 64 == 0


def records(scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N_pad / 16, K / 32, RECORD] "amx8" records (module docstring) of a weight in 8-bit block form
    (scales [N, K/32] float32, codes [N, K] int8); padding columns are zero."""
    n, k = codes.shape
    panels, blocks = -(-n // GROUP), k // 32
    body = torch.zeros(panels, blocks, RECORD, dtype=torch.uint8)
    padded = torch.zeros(panels * GROUP, blocks, dtype=torch.float32)
    padded[:n] = scales
    body[:, :, :64] = padded.view(panels, GROUP, blocks).permute(0, 2, 1).contiguous().view(torch.uint8).view(
        panels, blocks, 64)
    steps = torch.zeros(panels * GROUP, k, dtype=torch.int8)
    steps[:n] = codes
    steps = steps.view(panels, GROUP, blocks, 8, 4)  # panel, column, block, tile row, step of the row
    body[:, :, 64:] = steps.permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8).view(panels, blocks, 512)
    return body


def group_bytes(in_features: int) -> int:
    """Bytes of one whole group's (16 rows') prepared inputs in the scratch (`amx_kernel.group_bytes`)."""
    return amx_kernel.group_bytes(in_features, _region_bytes)


def scratch_floats(rows: int, in_features: int) -> int:
    """Floats of scratch `transpose` needs for `rows` rows of width `in_features`: every group's pieces and block
    scales, 64-byte aligned."""
    return amx_kernel.scratch_floats(rows, in_features, _region_bytes)


def _region_bytes(rows: int, in_features: int) -> int:
    """Bytes of one group's prepared inputs: its pieces [K/32, rows, PIECES, 32] int8, then its block scales
    [K/32, rows] float32, then SLACK (a last A tile of fewer rows still loads TILE_ROWS rows' pieces), rounded up to
    64."""
    blocks = in_features // 32
    return (blocks * rows * (PIECES * PIECE_BYTES + 4) + SLACK + 63) // 64 * 64


@functools.cache
def addresses() -> tuple[int, int]:
    """(address of `streamed_rows`, address of `transpose`) of the compiled module (`compiled_ir`'s disk cache).
    Raises `RuntimeError` where the kernel cannot run (`available`)."""
    if not available():
        raise RuntimeError("the AMX-INT8 kernel needs a CPU with AMX-INT8 and AVX-512, and Linux granting AMX tile "
                           "data")
    return compiled_addresses(module_ir(), ("streamed_rows", "transpose"), KIND)


def module_ir() -> str:
    """The module: `prepare`, the kernels `rows1` … `rows16`, `single`, `streamed_rows` and `transpose` (as
    `amx_kernel.module_ir`'s)."""
    declarations = [f"declare {V16F} @llvm.fma.v16f32({V16F}, {V16F}, {V16F})",
                    f"declare {V16F} @llvm.rint.v16f32({V16F})",
                    f"declare {V16I} @llvm.umax.v16i32({V16I}, {V16I})",
                    f"declare i32 @llvm.vector.reduce.umax.v16i32({V16I})",
                    "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)"]
    kernels = ["\n".join(kernel_ir(rows)) for rows in range(1, GROUP + 1)]
    region = functools.partial(_region_ir, PIECES * PIECE_BYTES + 4, SLACK)
    return "\n".join(declarations + [_prepare_ir()] + kernels + amx_kernel.driver_ir(region))


def _prepare_ir() -> str:
    """IR of `prepare(x, dest, M, K)`: the pieces and block scales of rows x [M, K] (float32, row-major) into dest
    (`_region_bytes(M, K)` bytes)."""
    out = ["define internal void @prepare(ptr %x, ptr %dest, i64 %M, i64 %K) {", "entry:",
           "  %blocks = udiv i64 %K, 32", "  %bm = mul i64 %blocks, %M",
           f"  %pieces_bytes = mul i64 %bm, {PIECES * PIECE_BYTES}",
           "  %scales = getelementptr i8, ptr %dest, i64 %pieces_bytes", "  br label %row",
           "row:", "  %m = phi i64 [0, %entry], [%m_next, %row_end]", "  br label %block",
           "block:", "  %b = phi i64 [0, %row], [%b_next, %block]", "  %k0 = mul i64 %b, 32",
           "  %mk = mul i64 %m, %K", "  %src = add i64 %mk, %k0", "  %lo_p = getelementptr float, ptr %x, i64 %src",
           "  %hi_p = getelementptr float, ptr %lo_p, i64 16", f"  %lo = load {V16F}, ptr %lo_p, align 4",
           f"  %hi = load {V16F}, ptr %hi_p, align 4",
           # the block's largest |x| by its bits (a NaN's bits are above infinity's), its biased exponent e
           f"  %lo_b = bitcast {V16F} %lo to {V16I}", f"  %hi_b = bitcast {V16F} %hi to {V16I}",
           f"  %lo_a = and {V16I} %lo_b, {splat_const(0x7FFFFFFF, 16, 'i32')}",
           f"  %hi_a = and {V16I} %hi_b, {splat_const(0x7FFFFFFF, 16, 'i32')}",
           f"  %both = call {V16I} @llvm.umax.v16i32({V16I} %lo_a, {V16I} %hi_a)",
           f"  %top = call i32 @llvm.vector.reduce.umax.v16i32({V16I} %both)", "  %e = lshr i32 %top, 23",
           "  %finite = icmp ult i32 %e, 255", "  %low = icmp ult i32 %e, 6", "  %e6 = select i1 %low, i32 6, i32 %e",
           # s = 2^(e - 132) (biased e - 5), 1/s = 2^(132 - e) (biased 259 - e); a NaN s where x is not finite
           "  %se = sub i32 %e6, 5", "  %sb = shl i32 %se, 23", "  %ie = sub i32 259, %e6", "  %ib = shl i32 %ie, 23",
           "  %sbits = select i1 %finite, i32 %sb, i32 2143289344", "  %s = bitcast i32 %sbits to float",
           "  %ibits = select i1 %finite, i32 %ib, i32 1065353216", "  %inv = bitcast i32 %ibits to float",
           *splat("invv", "%inv", 16), f"  %lo_r0 = fmul {V16F} %lo, %invv", f"  %hi_r0 = fmul {V16F} %hi, %invv",
           "  %bmr = mul i64 %b, %M", "  %slot = add i64 %bmr, %m",
           f"  %slot_bytes = mul i64 %slot, {PIECES * PIECE_BYTES}",
           "  %dst = getelementptr i8, ptr %dest, i64 %slot_bytes"]
    for p in range(PIECES):
        out += _piece_ir(p)
    return "\n".join(out + ["  %sp = getelementptr float, ptr %scales, i64 %slot", "  store float %s, ptr %sp, align 4",
                            "  %b_next = add i64 %b, 1", "  %b_end = icmp eq i64 %b_next, %blocks",
                            "  br i1 %b_end, label %row_end, label %block", "row_end:", "  %m_next = add i64 %m, 1",
                            "  %m_end = icmp eq i64 %m_next, %M", "  br i1 %m_end, label %exit, label %row",
                            "exit:", "  ret void", "}"])


def _piece_ir(p: int) -> list[str]:
    """IR of piece p of a block's two halves `%lo_r{p}` / `%hi_r{p}` (scaled inputs, |value| ≤ 64): rounded to
    integers and stored as int8 at the piece's 32 bytes, what is left (exact) times 128 to `%lo_r{p+1}` …"""
    out = []
    for half, offset in (("lo", 0), ("hi", 16)):
        r = f"%{half}_r{p}"
        out += [f"  %{half}_i{p} = call {V16F} @llvm.rint.v16f32({V16F} {r})",
                f"  %{half}_q{p} = fptosi {V16F} %{half}_i{p} to <16 x i8>",
                f"  %{half}_d{p} = getelementptr i8, ptr %dst, i64 {p * PIECE_BYTES + offset}",
                f"  store <16 x i8> %{half}_q{p}, ptr %{half}_d{p}, align 1",
                f"  %{half}_f{p} = fsub {V16F} {r}, %{half}_i{p}",
                f"  %{half}_r{p + 1} = fmul {V16F} %{half}_f{p}, {splat_const('128.0', 16)}"]
    return out


def _region_ir(per_block_row: int, slack: int, rows: str, tag: str) -> list[str]:
    """IR computing `%{tag}region` = `_region_bytes(rows, %K)` (rows an IR value)."""
    return [f"  %{tag}blocks = udiv i64 %K, 32", f"  %{tag}p = mul i64 %{tag}blocks, {rows}",
            f"  %{tag}pb = mul i64 %{tag}p, {per_block_row}", f"  %{tag}t = add i64 %{tag}pb, {slack + 63}",
            f"  %{tag}region = and i64 %{tag}t, -64"]


def _tiles_of(rows: int) -> int:
    """A tiles (of TILE_ROWS rows' pieces) a kernel of `rows` rows multiplies per block."""
    return -(-rows // TILE_ROWS)


def kernel_ir(rows: int) -> list[str]:
    """IR of `rows{rows}(i64 x, i64 w, i64 y, i64 K, i64 N, i64 lo, i64 hi)`: x the rows' prepared region, y
    [rows, N]; per panel lo ≤ b < hi, block 0's tiles, then blocks in pairs (tiles of the next block, scaling of
    the one before), the sums stored to y (`amx_kernel.kernel_shell`, `amx_kernel.block_pairs`)."""
    setup = ["  %sums = getelementptr i8, ptr %cfg, i64 64",
             f"  %pb = mul i64 %blocks, {rows * PIECES * PIECE_BYTES}", "  %s = getelementptr i8, ptr %x, i64 %pb"]
    return amx_kernel.kernel_shell(rows, SCRATCH, _tile_config(rows), setup,
                                   amx_kernel.block_pairs(rows, tiles, scale, guarded=True))


def _tile_config(rows: int) -> str:
    """The 64-byte tile configuration as an IR constant, palette 1: per tile set t (0, 1) the codes' B tile 4t
    (8 rows of 64 bytes), the pieces' A tile 4t + 1 (rows of 32 bytes) and two sums tiles 4t + 2, 4t + 3 (rows of
    64 bytes); A and sums tiles hold min(rows, TILE_ROWS) · PIECES rows."""
    data = [0] * 64
    data[0] = 1
    height = min(rows, TILE_ROWS) * PIECES
    for tile in range(8):
        role = tile % 4
        data[16 + 2 * tile] = PIECE_BYTES if role == 1 else 64
        data[48 + tile] = 8 if role == 0 else height
    return "<" + ", ".join(f"i8 {value}" for value in data) + ">"


def tiles(rows: int, parity: int, block: str, tag: str) -> list[str]:
    """IR of block `block`'s tile work (tile set `parity`): load its codes' B tile from the record, then per A tile
    of the rows' pieces: load it, zero the sums, one multiply-add, store the sums to buffer `parity`."""
    t, base = tag, 4 * parity
    out = [*amx_kernel.record_address(block, t, RECORD), f"  %{t}xo = mul i64 {block}, {rows * PIECES * PIECE_BYTES}",
           f"  %{t}xp = getelementptr i8, ptr %x, i64 %{t}xo", f"  %{t}cp = getelementptr i8, ptr %{t}rp, i64 64",
           f"  %{t}cbp = getelementptr i8, ptr %sums, i64 {parity * SUMS}"]
    for line in range(0, RECORD, 64):
        out += [f"  %{t}pf{line} = getelementptr i8, ptr %{t}rp, i64 {4 * RECORD + line}",
                f"  call void @llvm.prefetch.p0(ptr %{t}pf{line}, i32 0, i32 3, i32 1)"]
    asm = ["movq $$64, %r11", "movq $$32, %r10", f"tileloadd ($0,%r11,1), %tmm{base}"]
    for j in range(_tiles_of(rows)):
        total = base + 2 + j % 2
        asm += [f"tileloadd {j * TILE_ROWS * PIECES * PIECE_BYTES}($1,%r10,1), %tmm{base + 1}",
                f"tilezero %tmm{total}", f"tdpbssd %tmm{base}, %tmm{base + 1}, %tmm{total}",
                f"tilestored %tmm{total}, {j * 1024}($2,%r11,1)"]
    out.append('  call void asm sideeffect "' + "\\0A".join(asm)
               + f'", "r,r,r,~{{r10}},~{{r11}},~{{memory}}"(ptr %{t}cp, ptr %{t}xp, ptr %{t}cbp)')
    return out


def scale(rows: int, block: str, parity: int, tag: str, before, after) -> list[str]:
    """IR adding block `block`'s int32 sums (buffer `parity`) to each row's accumulator: d · s · Σ_p C_p / 2^(7p)."""
    t = tag
    out = [*amx_kernel.record_address(block, t, RECORD), f"  %{t}cb = getelementptr i8, ptr %sums, i64 {parity * SUMS}",
           f"  %{t}d = load {V16F}, ptr %{t}rp, align 64", f"  %{t}sb = mul i64 {block}, {rows}"]
    for m in range(rows):
        tile, slot = divmod(m, TILE_ROWS)
        c = [f"%{t}c{m}_{p}" for p in range(PIECES)]
        for p in range(PIECES):
            out += [f"  {c[p]}p = getelementptr i8, ptr %{t}cb, i64 {tile * 1024 + (slot * PIECES + p) * 64}",
                    f"  {c[p]}i = load {V16I}, ptr {c[p]}p, align 64", f"  {c[p]} = sitofp {V16I} {c[p]}i to {V16F}"]
        horner = c[-1]
        for p in range(PIECES - 2, -1, -1):
            out.append(f"  %{t}h{m}_{p} = call {V16F} @llvm.fma.v16f32({V16F} {horner}, {V16F} "
                       f"{splat_const(STEP, 16)}, {V16F} {c[p]})")
            horner = f"%{t}h{m}_{p}"
        out += [f"  %{t}si{m} = add i64 %{t}sb, {m}", f"  %{t}sp{m} = getelementptr float, ptr %s, i64 %{t}si{m}",
                f"  %{t}ss{m} = load float, ptr %{t}sp{m}", *splat(f"{t}sv{m}", f"%{t}ss{m}", 16),
                f"  %{t}ds{m} = fmul {V16F} %{t}d, %{t}sv{m}",
                f"  {after(m)} = call {V16F} @llvm.fma.v16f32({V16F} {horner}, {V16F} %{t}ds{m}, {V16F} {before(m)})"]
    return out
