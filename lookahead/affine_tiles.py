"""The AVX2 streamed kernel for "affine4" panels as register tiles written in assembly: a tile of P panels × M rows.

`affine_kernel` leaves register allocation to LLVM, which for two panels of four or more rows keeps every step's
rebuilt weights live at once and spills the accumulators (two panels of 4 rows ran slower than one panel). Here the
inner loop is inline assembly with every register placed by hand (16 AVX2 vector registers): the tile's M·P
accumulators, one weight vector per panel, one broadcast register, then, while registers are left, the code mask
and each panel's block scale. One loop iteration is one record (32 steps), fully unrolled; the block scale and
offset are read from the record each step where no register holds them, and the records are prefetched a fixed
distance ahead. The kernel around a tile (`tile_kernel_ir`: tiles over the panels, the one-panel rest) and a tile's
frame (`tile_frame`: the parameter block, the record loop, the stores) serve `affine_tiles512`'s AVX-512 tiles too.

Every column's sum is exactly `affine_kernel`'s: per step k = 0 … K-1 in order, the weight rebuilt as fma(q, d, m)
(`vfmadd213ps`: d·q + m, rounded once), then fma(x[m, k], w, acc) per row (`vfmadd231ps`) — the same bits for any
tile, row count or thread split (checked against the float32 panels by the tests). Tiles only change which panels
share a pass: more panels give each row more independent chains of multiply-adds, which a row count of 3–6 needs
to keep the multiply-add units busy, and let one broadcast of a row's input feed several panels.

Which row counts use a tile, and how many panels it holds, was measured on the default model's 210 layer products
(AVX2, AMD EPYC, 2 threads, ms for all of them, LLVM kernel → tile, medians, interleaved in one process, two runs):
3 rows 9.84 → 8.51 and 9.03 → 7.18 (3 panels), 4 rows 10.50 → 9.48 and 9.29 → 7.93 (2), 5 rows 11.83 → 10.48 and
10.78 → 11.27 (2; 12.1 → 10.0 in an earlier run), 6 rows 13.27 → 13.22 and 10.96 → 10.42 (2), 10 rows 23.64 → 22.10
and 20.11 → 16.95, 12 rows 28.55 → 26.69 and 24.74 → 19.44 (1). One row (5.77 → 5.80, 5.26 → 5.38 with 3 panels),
2, 7 and 8 rows were as fast or faster on the LLVM kernel, which keeps them.
"""

from __future__ import annotations

import sys
from types import ModuleType

from .affine_kernel import AFFINE_BLOCK, RECORD_FLOATS
from .compiled_ir import host_features
from .vector_ir import splat_const

WIDTH = 8  # floats per AVX2 vector register: the only width tiles are written for
VECTOR_REGISTERS = 16
TILE_PANELS = {3: 3, 4: 2, 5: 2, 6: 2, 9: 1, 10: 1, 11: 1, 12: 1}  # row count → panels per tile (measured)
PREFETCH_BYTES = 8192  # how far ahead of the record being computed its panel is prefetched
RECORD_BYTES = 4 * WIDTH * RECORD_FLOATS["affine4"]
SCRATCH_BYTES = 4 * WIDTH  # the code mask
PANEL_REGISTERS = ("%r8", "%r9", "%r10", "%r11")  # one record pointer per panel of a tile
# The parameter block the assembly reads (i64 each): first panel's record, bytes between panels, x, bytes between
# steps of x, records per panel, address of the code mask, y at the first panel's column, bytes between rows of y.
_PARAMETERS = ("panel", "panel_bytes", "x", "x_step", "records", "mask", "y", "y_row")


def tiled(rows: int, width: int, form: str) -> bool:
    """Whether products of `rows` rows on `form` panels of `width` floats run as tiles here: AVX2 "affine4" panels
    of the row counts in `TILE_PANELS` (the assembly's integer vector instructions need AVX2, which a CPU with FMA
    may lack), AVX-512 "affine4h" panels of those in `affine_tiles512.TILE_PANELS`."""
    from . import affine_tiles512 as wide  # imports this module's frame

    features = host_features().split(",")
    if width == WIDTH:
        return form == "affine4" and rows in TILE_PANELS and "+avx2" in features
    return width == wide.WIDTH and form == wide.FORM and rows in wide.TILE_PANELS and "+avx512f" in features


def tile_kernel_ir(rows: int, name: str, width: int = WIDTH) -> str:
    """LLVM IR of `void name(i64 x, i64 xs, i64 w, i64 y, i64 K, i64 N, i64 lo, i64 hi)` with the contract of
    `affine_kernel.affine_kernel_ir` for panels of `width` floats ("affine4" with AVX2's 8, "affine4h" with
    AVX-512's 16): panels lo ≤ b < hi in tiles of the width's measured panel count for `rows`, the panels left over
    one at a time. Raises `KeyError` for a row count without a tile."""
    isa = _isa(width)
    panels = isa.TILE_PANELS[rows]
    stores = "\n".join(f"  %p{i} = getelementptr i64, ptr %params, i64 {i}" for i in range(len(_PARAMETERS)))
    return f"""define internal void @{name}(i64 %xa, i64 %xs, i64 %wa, i64 %ya, i64 %K, i64 %N, i64 %lo, i64 %hi) {{
entry:
  %params = alloca [{len(_PARAMETERS)} x i64], align 8
  %mask = alloca [{isa.SCRATCH_BYTES // 4} x i32], align 64
  store <{width} x i32> {splat_const(15, width, 'i32')}, ptr %mask, align 64
{stores}
  %panel_bytes = mul i64 %K, {isa.RECORD_BYTES // AFFINE_BLOCK}
  store i64 %panel_bytes, ptr %p1
  store i64 %xa, ptr %p2
  %x_step = mul i64 %xs, 4
  store i64 %x_step, ptr %p3
  %records = udiv i64 %K, {AFFINE_BLOCK}
  store i64 %records, ptr %p4
  %mask_at = ptrtoint ptr %mask to i64
  store i64 %mask_at, ptr %p5
  %y_row = mul i64 %N, 4
  store i64 %y_row, ptr %p7
  br label %tile
tile:
  %b = phi i64 [%lo, %entry], [%b_tile, %whole], [%b_one, %single]
  %b_end = add i64 %b, {panels}
  %fits = icmp sle i64 %b_end, %hi
  br i1 %fits, label %whole, label %rest
whole:
{_call(isa, rows, panels, 'whole')}
  %b_tile = add i64 %b, {panels}
  br label %tile
rest:
  %left = icmp slt i64 %b, %hi
  br i1 %left, label %single, label %exit
single:
{_call(isa, rows, 1, 'single')}
  %b_one = add i64 %b, 1
  br label %tile
exit:
  ret void
}}"""


def _isa(width: int) -> ModuleType:
    """The module whose tiles are written for panels of `width` floats: this one (AVX2) or `affine_tiles512`."""
    from . import affine_tiles512

    return affine_tiles512 if width == affine_tiles512.WIDTH else sys.modules[__name__]


def _call(isa: ModuleType, rows: int, panels: int, tag: str) -> str:
    """IR (values named after `tag`): point the parameter block at panel %b (its records and its column of y), then
    run `isa`'s tile."""
    text, constraints = isa.tile_assembly(rows, panels)
    return (f"  %{tag}w = mul i64 %b, %panel_bytes\n  %{tag}wa = add i64 %wa, %{tag}w\n  store i64 %{tag}wa, ptr %p0\n"
            f"  %{tag}y = mul i64 %b, {4 * isa.WIDTH}\n  %{tag}ya = add i64 %ya, %{tag}y\n"
            f"  store i64 %{tag}ya, ptr %p6\n"
            f"  call void asm sideeffect \"{text}\", \"{constraints}\"(ptr %params)")


def tile_assembly(rows: int, panels: int) -> tuple[str, str]:
    """(AT&T assembly as an LLVM inline-asm string, its constraints) of one tile: `rows` rows × `panels` panels over
    all records, the sums stored to y. Raises `ValueError` when the tile does not fit the vector registers."""
    if rows < 1 or panels < 1 or rows * panels + panels + 1 > VECTOR_REGISTERS or panels > len(PANEL_REGISTERS):
        raise ValueError(f"a tile of {rows} rows × {panels} panels does not fit {VECTOR_REGISTERS} registers")
    registers = _Registers(rows, panels)

    def record_start(c: int, pointer: str) -> list[str]:
        return [f"vmovups ({pointer}), %ymm{registers.scales[c]}"] if registers.scales else []

    load_mask = None if registers.mask is None else f"vmovdqu (%rbx), %ymm{registers.mask}"
    return tile_frame(sys.modules[__name__], registers.sums, load_mask, record_start,
                      lambda step, pointers: _step(step, rows, pointers, registers))


def tile_frame(isa: ModuleType, sums: dict, load_mask: str | None, record_start, step) -> tuple[str, str]:
    """(assembly, constraints) of a tile of `isa` (this module or `affine_tiles512`) around its arithmetic: read the
    parameter block, zero the accumulators `sums[m, c]` (register numbers), load the code mask (`load_mask`, an
    instruction or None), then per record `record_start(c, pointer)` for each panel after its prefetches and the
    32 steps `step(step, pointers)`, the panel pointers moved on; at the end each row's sums stored to y."""
    rows, panels = max(m for m, _ in sums) + 1, max(c for _, c in sums) + 1
    vector, zero = ("zmm", "vpxord") if isa.WIDTH == 16 else ("ymm", "vxorps")
    pointers = PANEL_REGISTERS[:panels]
    lines = ["movq 0($0), %r8", "movq 8($0), %rcx"] + [f"leaq ({a},%rcx), {b}" for a, b in zip(pointers, pointers[1:])]
    lines += ["movq 16($0), %rsi", "movq 24($0), %rdi", "movq 32($0), %rdx", "movq 40($0), %rbx"]
    lines += [f"{zero} %{vector}{r}, %{vector}{r}, %{vector}{r}" for r in sums.values()]
    lines += [load_mask] if load_mask else []
    lines.append("1:")
    for c, pointer in enumerate(pointers):
        lines += [f"prefetcht0 {isa.PREFETCH_BYTES + 64 * line}({pointer})"
                  for line in range(isa.RECORD_BYTES // 64)]
        lines += record_start(c, pointer)
    for k in range(AFFINE_BLOCK):
        lines += step(k, pointers)
    lines += [f"addq $${isa.RECORD_BYTES}, {pointer}" for pointer in pointers]
    lines += ["decq %rdx", "jnz 1b", "movq 48($0), %rax", "movq 56($0), %rcx"]
    for m in range(rows):
        lines += [f"vmovups %{vector}{sums[m, c]}, {4 * isa.WIDTH * c}(%rax)" for c in range(panels)]
        lines.append("addq %rcx, %rax")
    clobbers = [f"~{{{r}}}" for r in ("rax", "rbx", "rcx", "rdx", "rsi", "rdi")]
    clobbers += [f"~{{{p[1:]}}}" for p in pointers] + [f"~{{{vector}{i}}}" for i in range(isa.VECTOR_REGISTERS)]
    clobbers += ["~{memory}", "~{dirflag}", "~{fpsr}", "~{flags}"]
    return "\\0A".join(lines), ",".join(["r", *clobbers])


class _Registers:
    """Vector register numbers of a tile: `sums[m, c]`, `weights[c]`, `broadcast`, then `mask` and `scales[c]`
    while registers are left (None / empty where the assembly reads them from memory instead)."""

    def __init__(self, rows: int, panels: int):
        self.sums = {(m, c): m * panels + c for m in range(rows) for c in range(panels)}
        self.weights = [rows * panels + c for c in range(panels)]
        self.broadcast = rows * panels + panels
        free = list(range(self.broadcast + 1, VECTOR_REGISTERS))
        self.mask = free.pop(0) if free else None
        self.scales = free[:panels] if len(free) >= panels else []


def _step(step: int, rows: int, pointers: tuple[str, ...], registers: _Registers) -> list[str]:
    """One step of a record: rebuild each panel's weight vector w = fma(q, d, m) from its 4-bit codes, then one
    multiply-add per row and panel with the row's broadcast input; x moves on to the next step."""
    group, nibble = divmod(step, 8)
    mask = f"%ymm{registers.mask}" if registers.mask is not None else "(%rbx)"
    lines = []
    for c, pointer in enumerate(pointers):
        w = f"%ymm{registers.weights[c]}"
        lines.append(f"vmovdqu {8 * WIDTH + 4 * WIDTH * group}({pointer}), {w}")
        if nibble:
            lines.append(f"vpsrld $${4 * nibble}, {w}, {w}")
        lines += [f"vpand {mask}, {w}, {w}", f"vcvtdq2ps {w}, {w}"]
        scale = f"%ymm{registers.scales[c]}" if registers.scales else f"%ymm{registers.broadcast}"
        if not registers.scales:
            lines.append(f"vmovups ({pointer}), {scale}")
        lines.append(f"vfmadd213ps {4 * WIDTH}({pointer}), {scale}, {w}")
    return lines + row_products(rows, len(pointers), registers, "ymm")


def row_products(rows: int, panels: int, registers, vector: str) -> list[str]:
    """A step's multiply-adds: per row its input broadcast into `registers.broadcast`, then one multiply-add per
    panel into the row's sums (`vector` registers: "ymm" or "zmm"); x then moves on to the next step."""
    lines = []
    for m in range(rows):
        lines.append(f"vbroadcastss {4 * m}(%rsi), %{vector}{registers.broadcast}")
        lines += [f"vfmadd231ps %{vector}{registers.weights[c]}, %{vector}{registers.broadcast}, "
                  f"%{vector}{registers.sums[m, c]}" for c in range(panels)]
    return lines + ["addq %rdi, %rsi"]

