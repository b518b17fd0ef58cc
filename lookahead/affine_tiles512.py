"""The AVX-512 streamed kernel for "affine4h" panels as register tiles written in assembly: P panels × M rows.

`affine_kernel` computes three panels at once for 1–4 rows with AVX-512 and one panel for more (LLVM spills the
accumulators of two panels from 6 rows on). With one panel, five rows are five chains of dependent multiply-adds,
fewer than the two multiply-add pipes need to hide their latency, so the default model's 120 layer products cost
~1.0–1.1 ms more at 5 rows than at 4, where each further row of 1–4 costs ~0.35 ms. Here, as `affine_tiles` does
for AVX2, the inner loop is inline assembly with every register placed by hand (32 AVX-512 registers): the tile's
M·P accumulators, one weight vector per panel, one broadcast register, each panel's block scales d, then — while
registers are left — its block offsets m (else from a scratch slot beside the code mask) and the code mask (else
read from memory). One loop iteration is one record (32 steps), fully unrolled; the records are prefetched a fixed
distance ahead.

Which row counts use a tile was measured on the default model's 120 layer products (Zen 5, 2 threads, ms for all
of them, LLVM kernel → tile, medians of 11, interleaved in one process, bit-identical outputs; two runs): 5 rows
5.03 → 4.56 and 4.51 → 4.12 (2 panels; 3 panels 5.19); 4 rows 3.90 → 4.17 and 3.48 → 3.81 (2 panels; 3 panels
4.73), 6 rows 5.26 → 5.22 and 4.71 → 4.75, 7 rows 5.56 → 5.60, 8 rows 6.08 → 6.26 (2 panels; 3 panels slower):
from six rows on one panel has chains enough, so only five rows take a tile.

At each record a panel's 16 words of float16 halves (d low, m high) are widened to float32 (`vpmovdw` +
`vcvtph2ps`, exact, as the LLVM kernel's `fpext`). Every column's sum is exactly `affine_kernel`'s: per step k = 0 …
K-1 in order, the weight rebuilt as fma(q, d, m) (`vfmadd213ps`: d·q + m, rounded once), then fma(x[m, k], w, acc)
per row (`vfmadd231ps`) — the same bits for any tile, row count or thread split (checked against the float32
panels by the tests).
"""

from __future__ import annotations

import sys

from .affine_kernel import RECORD_FLOATS
from .affine_tiles import PANEL_REGISTERS, row_products, tile_frame

WIDTH = 16  # floats per AVX-512 vector register: the only width these tiles are written for
VECTOR_REGISTERS = 32
FORM = "affine4h"
TILE_PANELS = {5: 2}  # row count → panels per tile (measured: the module docstring)
PREFETCH_BYTES = 8192  # how far ahead of the record being computed its panel is prefetched
RECORD_BYTES = 4 * WIDTH * RECORD_FLOATS[FORM]
_CODES_AT = 4 * WIDTH  # a record's code lanes follow its one word of halves per column
SCRATCH_BYTES = 4 * WIDTH * (1 + len(PANEL_REGISTERS))  # the code mask, then one offsets slot per panel


def tile_assembly(rows: int, panels: int) -> tuple[str, str]:
    """(AT&T assembly as an LLVM inline-asm string, its constraints) of one tile: `rows` rows × `panels` panels over
    all records, the sums stored to y, reading `affine_tiles`' parameter block (the code mask's address: the
    scratch area of SCRATCH_BYTES, 64-byte aligned). Raises `ValueError` when the tile does not fit the vector
    registers."""
    if rows < 1 or panels < 1 or rows * panels + 2 * panels + 1 > VECTOR_REGISTERS or panels > len(PANEL_REGISTERS):
        raise ValueError(f"a tile of {rows} rows × {panels} panels does not fit {VECTOR_REGISTERS} registers")
    registers = _Registers(rows, panels)
    load_mask = None if registers.mask is None else f"vmovdqu32 (%rbx), %zmm{registers.mask}"
    return tile_frame(sys.modules[__name__], registers.sums, load_mask,
                      lambda c, pointer: _widen_halves(c, pointer, registers),
                      lambda step, pointers: _step(step, rows, pointers, registers))


class _Registers:
    """Vector register numbers of a tile: `sums[m, c]`, `weights[c]`, `broadcast`, `scales[c]`, then `offsets[c]`
    and `mask` while registers are left (empty / None where the assembly reads them from the scratch area)."""

    def __init__(self, rows: int, panels: int):
        self.sums = {(m, c): m * panels + c for m in range(rows) for c in range(panels)}
        self.weights = [rows * panels + c for c in range(panels)]
        self.broadcast = rows * panels + panels
        self.scales = [self.broadcast + 1 + c for c in range(panels)]
        free = list(range(self.scales[-1] + 1, VECTOR_REGISTERS))
        self.offsets = free[:panels] if len(free) >= panels else []
        free = free[len(self.offsets):]
        self.mask = free[0] if free else None


def _widen_halves(c: int, pointer: str, registers: _Registers) -> list[str]:
    """Panel c's record start: its 16 words of float16 halves widened to float32 scales d (low halves) and offsets
    m (high halves), m into its register or its scratch slot; the panel's weight register is the temporary."""
    w, d = registers.weights[c], registers.scales[c]
    lines = [f"vmovdqu32 ({pointer}), %zmm{w}", f"vpmovdw %zmm{w}, %ymm{d}", f"vcvtph2ps %ymm{d}, %zmm{d}",
             f"vpsrld $$16, %zmm{w}, %zmm{w}", f"vpmovdw %zmm{w}, %ymm{w}"]
    if registers.offsets:
        return lines + [f"vcvtph2ps %ymm{w}, %zmm{registers.offsets[c]}"]
    return lines + [f"vcvtph2ps %ymm{w}, %zmm{w}", f"vmovaps %zmm{w}, {_offset_slot(c)}(%rbx)"]


def _offset_slot(c: int) -> int:
    """Byte offset of panel c's float32 offsets in the scratch area (after the code mask)."""
    return 4 * WIDTH * (1 + c)


def _step(step: int, rows: int, pointers: tuple[str, ...], registers: _Registers) -> list[str]:
    """One step of a record: rebuild each panel's weight vector w = fma(q, d, m) from its 4-bit codes, then one
    multiply-add per row and panel with the row's broadcast input; x moves on to the next step."""
    group, nibble = divmod(step, 8)
    mask = f"%zmm{registers.mask}" if registers.mask is not None else "(%rbx)"
    lines = []
    for c, pointer in enumerate(pointers):
        w, codes = f"%zmm{registers.weights[c]}", f"{_CODES_AT + 4 * WIDTH * group}({pointer})"
        lines.append(f"vpsrld $${4 * nibble}, {codes}, {w}" if nibble else f"vmovdqu32 {codes}, {w}")
        offsets = f"%zmm{registers.offsets[c]}" if registers.offsets else f"{_offset_slot(c)}(%rbx)"
        lines += [f"vpandd {mask}, {w}, {w}", f"vcvtdq2ps {w}, {w}",
                  f"vfmadd213ps {offsets}, %zmm{registers.scales[c]}, {w}"]
    return lines + row_products(rows, len(pointers), registers, "zmm")
