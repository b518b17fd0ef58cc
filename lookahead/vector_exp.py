"""Cephes' single-precision exp, the one formula every attention kernel of lookahead uses, and the LLVM IR pieces
the AVX-512 kernels (`prefill_attention`, `decode_attention`) build it and their constant vectors from.

x = n·ln 2 + r with n = rint(x·log2 e) and ln 2 split in a high and a low part, then e^r ≈ 1 + r + r²·p(r) (p's
coefficients highest degree first), times 2^n written into the exponent bits; arguments below EXP_FLOOR are taken
as giving 0 (the true value is below 1.7e-38). `fused_kernels._exp_below` computes the same formula in numba.
"""

from __future__ import annotations

import struct

import numpy as np

LOG2E = np.float32(1.4426950408889634)
EXP_FLOOR = np.float32(-87.0)  # exp of anything below is taken as 0 (true value < 1.7e-38)
EXP_LN2 = (np.float32(0.693359375), np.float32(-2.12194440e-4))
EXP_POLYNOMIAL = (np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3),
                  np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1))

LANES = 16  # floats per AVX-512 vector
VEC = f"<{LANES} x float>"
NEGATIVE_INFINITY = "0xFFF0000000000000"  # an IR float literal


def splat(name: str, scalar: str) -> list[str]:
    """IR: %{name} = a vector of 16 copies of the float `scalar`."""
    return [f"  %{name}_h = insertelement {VEC} poison, float {scalar}, i32 0",
            f"  %{name} = shufflevector {VEC} %{name}_h, {VEC} poison, <{LANES} x i32> zeroinitializer"]


def splat_const(value: str) -> str:
    """An IR constant vector of 16 floats, each `value` (an IR float literal)."""
    return "<" + ", ".join([f"float {value}"] * LANES) + ">"


def float_literal(value: float) -> str:
    """`value` as an IR float literal (the double of the float32 nearest it, in hex, as LLVM requires)."""
    single = struct.unpack("<f", struct.pack("<f", value))[0]
    return "0x" + struct.pack(">d", single).hex().upper()


def vector_declarations() -> list[str]:
    """IR declarations of the intrinsics on vectors of 16 floats the AVX-512 attention kernels use (`exp_ir`'s
    among them: fma, maxnum, rint), then `exp_ir`'s `vexp`."""
    return [f"declare {VEC} @llvm.fma.v{LANES}f32({VEC}, {VEC}, {VEC})",
            f"declare {VEC} @llvm.maxnum.v{LANES}f32({VEC}, {VEC})",
            f"declare {VEC} @llvm.rint.v{LANES}f32({VEC})",
            f"declare float @llvm.vector.reduce.fmax.v{LANES}f32({VEC})",
            f"declare float @llvm.vector.reduce.fadd.v{LANES}f32(float, {VEC})", exp_ir()]


def exp_ir() -> str:
    """IR of `vexp(x)` on 16 floats: e^x for x ≤ 0 (x clamped at EXP_FLOOR), Cephes' formula (module docstring).
    The caller declares llvm.fma, llvm.maxnum and llvm.rint for vectors of 16 floats."""
    c = {name: splat_const(float_literal(value)) for name, value in
         (("clamp", EXP_FLOOR), ("log2e", LOG2E), ("ln2_hi", EXP_LN2[0]), ("ln2_lo", EXP_LN2[1]))}
    poly = [splat_const(float_literal(value)) for value in EXP_POLYNOMIAL]
    fma = f"@llvm.fma.v{LANES}f32"
    lines = [f"define internal {VEC} @vexp({VEC} %in) alwaysinline {{",
             f"  %x = call {VEC} @llvm.maxnum.v{LANES}f32({VEC} %in, {VEC} {c['clamp']})",
             f"  %xl = fmul {VEC} %x, {c['log2e']}", f"  %n = call {VEC} @llvm.rint.v{LANES}f32({VEC} %xl)",
             f"  %nh = fneg {VEC} %n",
             f"  %t1 = call {VEC} {fma}({VEC} %nh, {VEC} {c['ln2_hi']}, {VEC} %x)",
             f"  %t = call {VEC} {fma}({VEC} %nh, {VEC} {c['ln2_lo']}, {VEC} %t1)"]
    previous = poly[0]
    for i, coefficient in enumerate(poly[1:]):
        lines.append(f"  %p{i} = call {VEC} {fma}({VEC} {previous}, {VEC} %t, {VEC} {coefficient})")
        previous = f"%p{i}"
    one = splat_const(float_literal(1.0))
    lines += [f"  %tt = fmul {VEC} %t, %t", f"  %y1 = call {VEC} {fma}({VEC} {previous}, {VEC} %tt, {VEC} %t)",
              f"  %y = fadd {VEC} %y1, {one}", f"  %ni = fptosi {VEC} %n to <{LANES} x i32>",
              f"  %bi = add <{LANES} x i32> %ni, <{', '.join(['i32 127'] * LANES)}>",
              f"  %bs = shl <{LANES} x i32> %bi, <{', '.join(['i32 23'] * LANES)}>",
              f"  %pow = bitcast <{LANES} x i32> %bs to {VEC}", f"  %r = fmul {VEC} %y, %pow", f"  ret {VEC} %r", "}"]
    return "\n".join(lines)
