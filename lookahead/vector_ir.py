"""The LLVM IR pieces the compiled attention kernels (`attention_kernel`, `prefill_attention`, `decode_attention`)
share: a vector width's types and constants (`Width`), a query's multiply-add chain against a key (`chain`), the
pairwise sums that turn per-key vectors into scores (`pairwise`), and Cephes' single-precision exp, the one formula
every attention kernel of lookahead uses (its constants, and `exp_ir`).

The exp: x = n·ln 2 + r with n = rint(x·log2 e) and ln 2 split in a high and a low part, then e^r ≈ 1 + r + r²·p(r) (p's
coefficients highest degree first), times 2^n written into the exponent bits; arguments below EXP_FLOOR are taken
as giving 0 (the true value is below 1.7e-38). `fused_kernels._exp_below` computes the same formula in numba.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

LOG2E = np.float32(1.4426950408889634)
EXP_FLOOR = np.float32(-87.0)  # exp of anything below is taken as 0 (true value < 1.7e-38)
EXP_LN2 = (np.float32(0.693359375), np.float32(-2.12194440e-4))
EXP_POLYNOMIAL = (np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3),
                  np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1))

LANES = 16  # floats per AVX-512 vector
VEC = f"<{LANES} x float>"
NEGATIVE_INFINITY = "0xFFF0000000000000"  # an IR float literal


def splat(name: str, scalar: str, lanes: int = LANES) -> list[str]:
    """IR: %{name} = a vector of `lanes` copies of the float `scalar`."""
    vec = f"<{lanes} x float>"
    return [f"  %{name}_h = insertelement {vec} poison, float {scalar}, i32 0",
            f"  %{name} = shufflevector {vec} %{name}_h, {vec} poison, <{lanes} x i32> zeroinitializer"]


def splat_const(value, lanes: int = LANES, kind: str = "float") -> str:
    """An IR constant vector of `lanes` `kind` lanes (float, or an integer type such as i32), each `value` (an IR
    literal of that type)."""
    return "<" + ", ".join([f"{kind} {value}"] * lanes) + ">"


def float_literal(value: float) -> str:
    """`value` as an IR float literal (the double of the float32 nearest it, in hex, as LLVM requires)."""
    single = struct.unpack("<f", struct.pack("<f", value))[0]
    return "0x" + struct.pack(">d", single).hex().upper()


def vector_declarations(lanes: int = LANES) -> list[str]:
    """IR declarations of the intrinsics on vectors of `lanes` floats the attention kernels use (`exp_ir`'s among
    them: fma, maxnum, rint), then `exp_ir`'s `vexp`."""
    vec = f"<{lanes} x float>"
    return [f"declare {vec} @llvm.fma.v{lanes}f32({vec}, {vec}, {vec})",
            f"declare {vec} @llvm.maxnum.v{lanes}f32({vec}, {vec})",
            f"declare {vec} @llvm.rint.v{lanes}f32({vec})",
            f"declare float @llvm.vector.reduce.fmax.v{lanes}f32({vec})",
            f"declare float @llvm.vector.reduce.fadd.v{lanes}f32(float, {vec})", exp_ir(lanes)]


def exp_ir(lanes: int = LANES) -> str:
    """IR of `vexp(x)` on `lanes` floats: e^x for x ≤ 0 (x clamped at EXP_FLOOR), Cephes' formula (module
    docstring). The caller declares llvm.fma, llvm.maxnum and llvm.rint for vectors of `lanes` floats."""
    vec = f"<{lanes} x float>"
    c = {name: splat_const(float_literal(value), lanes) for name, value in
         (("clamp", EXP_FLOOR), ("log2e", LOG2E), ("ln2_hi", EXP_LN2[0]), ("ln2_lo", EXP_LN2[1]))}
    poly = [splat_const(float_literal(value), lanes) for value in EXP_POLYNOMIAL]
    fma = f"@llvm.fma.v{lanes}f32"
    lines = [f"define internal {vec} @vexp({vec} %in) alwaysinline {{",
             f"  %x = call {vec} @llvm.maxnum.v{lanes}f32({vec} %in, {vec} {c['clamp']})",
             f"  %xl = fmul {vec} %x, {c['log2e']}", f"  %n = call {vec} @llvm.rint.v{lanes}f32({vec} %xl)",
             f"  %nh = fneg {vec} %n",
             f"  %t1 = call {vec} {fma}({vec} %nh, {vec} {c['ln2_hi']}, {vec} %x)",
             f"  %t = call {vec} {fma}({vec} %nh, {vec} {c['ln2_lo']}, {vec} %t1)"]
    previous = poly[0]
    for i, coefficient in enumerate(poly[1:]):
        lines.append(f"  %p{i} = call {vec} {fma}({vec} {previous}, {vec} %t, {vec} {coefficient})")
        previous = f"%p{i}"
    one = splat_const(float_literal(1.0), lanes)
    lines += [f"  %tt = fmul {vec} %t, %t", f"  %y1 = call {vec} {fma}({vec} {previous}, {vec} %tt, {vec} %t)",
              f"  %y = fadd {vec} %y1, {one}", f"  %ni = fptosi {vec} %n to <{lanes} x i32>",
              f"  %bi = add <{lanes} x i32> %ni, <{', '.join(['i32 127'] * lanes)}>",
              f"  %bs = shl <{lanes} x i32> %bi, <{', '.join(['i32 23'] * lanes)}>",
              f"  %pow = bitcast <{lanes} x i32> %bs to {vec}", f"  %r = fmul {vec} %y, %pow", f"  ret {vec} %r", "}"]
    return "\n".join(lines)


@dataclass(frozen=True)
class Width:
    """The vector width a kernel is written for, `lanes` floats, and the IR types and constants that go with it."""

    lanes: int

    @property
    def vec(self) -> str:
        """The IR type of a vector of floats."""
        return f"<{self.lanes} x float>"

    @property
    def mask(self) -> str:
        """The IR type of a vector of booleans, one per lane."""
        return f"<{self.lanes} x i1>"

    @property
    def index(self) -> str:
        """An IR constant: the lanes' indices 0 … lanes − 1 as a vector of i64."""
        return "<" + ", ".join(f"i64 {i}" for i in range(self.lanes)) + ">"

    @property
    def levels(self) -> int:
        """The levels of a tree of pairwise sums over the lanes."""
        return self.lanes.bit_length() - 1

    def splat(self, name: str, scalar: str) -> list[str]:
        """IR: %{name} = a vector of copies of the float `scalar`."""
        return splat(name, scalar, self.lanes)

    def const(self, value: str) -> str:
        """An IR constant vector, each lane the float literal `value`."""
        return splat_const(value, self.lanes)


def chain(w: Width, name: str, query: str, key: str, vectors: int) -> list[str]:
    """IR: %{name} = the lane-wise multiply-add chain of the query's vectors %{query}0 … with the key's at pointer
    %{key}: a product for the first vector, then one multiply-add per further vector, in order."""
    out = []
    for v in range(vectors):
        out += [f"  %{name}_p{v} = getelementptr float, ptr %{key}, i64 {v * w.lanes}",
                f"  %{name}_k{v} = load {w.vec}, ptr %{name}_p{v}, align 4"]
        target = name if v == vectors - 1 else f"{name}_a{v}"
        if v == 0:
            out.append(f"  %{target} = fmul {w.vec} %{query}0, %{name}_k0")
        else:
            out.append(f"  %{target} = call {w.vec} @llvm.fma.v{w.lanes}f32({w.vec} %{query}{v}, "
                       f"{w.vec} %{name}_k{v}, {w.vec} %{name}_a{v - 1})")
    return out


def pairwise(w: Width, name: str, a: str, b: str) -> list[str]:
    """IR: %{name} = [a₀+a₁, a₂+a₃, …, b₀+b₁, b₂+b₃, …] (neighbouring lanes of a, then of b, added)."""
    even = "<" + ", ".join(f"i32 {2 * i}" for i in range(w.lanes)) + ">"
    odd = "<" + ", ".join(f"i32 {2 * i + 1}" for i in range(w.lanes)) + ">"
    return [f"  %{name}_e = shufflevector {w.vec} %{a}, {w.vec} %{b}, <{w.lanes} x i32> {even}",
            f"  %{name}_o = shufflevector {w.vec} %{a}, {w.vec} %{b}, <{w.lanes} x i32> {odd}",
            f"  %{name} = fadd {w.vec} %{name}_e, %{name}_o"]
