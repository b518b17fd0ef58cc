"""LLVM IR of the streamed kernel for weights in an exact block form (`affine_weights`): "affine4" panels (4-bit
codes, a scale and an offset per block of 32, as GGUF's Q4_0 / Q4_1) and "scaled8" panels (8-bit codes and a scale
per block, as GGUF's Q8_0).

"affine4": each panel (P columns, P = the vector width) is K / 32 records of 24·P bytes, one per block of 32 steps: the
block's scales d [P] and offsets m [P] (float32), then four groups of P 32-bit lanes, lane j of group g holding
column j's 4-bit codes q of steps 8g … 8g + 7 (step 8g + i in bits 4i … 4i + 3). The kernel rebuilds each weight
in registers as w = fma(q, d, m), the float32 value d·q + m rounded once (d·q is exact: the codes have 4 bits and
d at most 11 significant bits where it comes from GGUF, and `affine_weights` checks every weight equals it bit
for bit), then does what `streamed_gemm.kernel_ir` does with it: per step, one multiply-add per row, k = 0 … K-1
in order. So every row gets the very multiply-adds of the float32 kernel on the weights themselves — the same
bits — from 0.75 bytes per weight instead of 4.

"affine4h" (AVX-512 only): the "affine4" record with each column's d and m as float16 halves of one 32-bit lane
(d in bits 0 … 15, m in bits 16 … 31), 20·P bytes; the kernel widens them to float32 (exact) and rebuilds as for
"affine4". On the default model's layers (2 threads, Zen 5, all 120 products called from Python, medians of 25,
interleaved, bit-identical outputs): 80 → 66 MB a step, 1 row 4.02 → 3.23 ms, 2 rows 4.46 → 3.78, 3 rows 4.69 →
4.07, 4 rows 5.41 → 4.52, 8 rows 7.03 → 6.94 (the products stream from memory at ~33 of the ~38 GB/s a cold
40 MB sum reads here, so fewer bytes are the lever).

"scaled8": each record is 36·P bytes: the block's scales d [P] (float32), then its 32 steps' P signed 8-bit codes
each; w = d · q, exact (8-bit codes, d with at most 11 significant bits where it comes from GGUF, checked bit for
bit): 1.125 bytes per weight.

Rebuilding a weight vector takes four operations (shift, mask, convert, multiply-add), so one to three rows become
compute-bound where the float32 kernel waits on memory, and one row's sum is a chain of dependent multiply-adds:
a few rows compute several panels at once (`affine_panels_per_pass`: two for 1–3 rows with AVX2, three for 1–4 with
AVX-512; independent chains, each column's sum in its own order), the panels left over alone.
"""

from __future__ import annotations

from .vector_ir import splat_const

AFFINE_BLOCK = 32  # weights along K sharing one scale and offset (GGUF's Q4_0 / Q4_1 block)
# Bytes prefetched ahead, in float32 vectors' worth (8 KB with AVX2, ~1400 steps of 0.75-byte weights). Measured
# on the default model's products, one row (AVX2, noisy): 64 → 8.9 ms, 128 → 6.8–7.4, 256 → 6.2–9.1,
# 512 → 6.4–7.6, 1024 → 7.4.
AFFINE_PREFETCH_STEPS = 256
RECORD_FLOATS = {"affine4": 6, "affine4h": 5, "scaled8": 9}  # a record's size per panel column, in 4-byte words
FOUR_BIT = ("affine4", "affine4h")  # the forms of 4-bit codes with a scale and an offset per block
_SIGNATURE = "(i64 %xa, i64 %xs, i64 %wa, i64 %ya, i64 %K, i64 %N, i64 %lo, i64 %hi)"


def affine_kernel_ir(rows: int, width: int, prefetch: int = AFFINE_PREFETCH_STEPS, name: str = "panel_rows",
                     form: str = "affine4") -> str:
    """LLVM IR of `void name(i64 x, i64 xs, i64 w, i64 y, i64 K, i64 N, i64 lo, i64 hi)` with the contract of
    `streamed_gemm.kernel_ir` (x transposed [K, xs], y [rows, N], panels lo ≤ b < hi) for panels of `form`
    ("affine4", "affine4h" or "scaled8", see the module docstring) at `w` (K a multiple of 32). Products of the row
    counts measured faster as hand-placed register tiles (AVX2 "affine4": `affine_tiles`; AVX-512 "affine4h":
    `affine_tiles512`) are that module's kernel instead."""
    if form not in RECORD_FLOATS:
        raise ValueError(f"exact block forms are {list(RECORD_FLOATS)}, got {form!r}")
    from . import affine_tiles  # imports this module's constants

    if affine_tiles.tiled(rows, width, form):
        return affine_tiles.tile_kernel_ir(rows, name, width)
    out = [f"define internal void @{name}{_SIGNATURE} {{",
           "entry:\n  %x = inttoptr i64 %xa to ptr\n  %w = inttoptr i64 %wa to ptr\n  %y = inttoptr i64 %ya to ptr",
           f"  %records = udiv i64 %K, {AFFINE_BLOCK}\n  %groups = udiv i64 %K, 8"]
    out += panel_passes(affine_panels_per_pass(rows, width),
                        lambda tag, together, edges: _panel_loop(form, tag, rows, together, width, prefetch, edges))
    return "\n".join(out)


def panel_passes(together: int, loop) -> list[str]:
    """IR of a kernel after its entry block: panels lo ≤ b < hi, `together` at a time by `loop("M", together,
    edges)`, then the ones left over one at a time by `loop("T", 1, edges)` (that loop alone when `together` is 1),
    then the exit block. `edges` = (block the loop is entered from, first panel, end, block to branch to when done)."""
    if together == 1:
        return ["  br label %Tpanel", *loop("T", 1, ("entry", "%lo", "%hi", "exit")), "exit:\n  ret void\n}"]
    return [f"  %span = sub i64 %hi, %lo\n  %whole = udiv i64 %span, {together}",
            f"  %wide = mul i64 %whole, {together}\n  %mid = add i64 %lo, %wide\n  br label %Mpanel",
            *loop("M", together, ("entry", "%lo", "%mid", "Tpanel")),
            *loop("T", 1, ("Mpanel", "%mid", "%hi", "exit")), "exit:\n  ret void\n}"]


def affine_panels_per_pass(rows: int, width: int) -> int:
    """Panels a kernel of `rows` rows on panels `width` floats wide computes at once: enough independent sums to
    hide the multiply-add's latency with the registers at hand. AVX2 (8 wide, 16 registers): 2 for up to 3 rows,
    else 1 (the default model's products, one row: 4 panels 11.9 ms (registers spilled), 2 panels 7.0 ms, 1 panel
    10.0 ms). AVX-512 (16 wide, 32 registers): 3 for up to 4 rows, else 1 — the default model's 120 layer products
    (Zen 5, 2 threads, ms for all of them, 2 → 3 panels, medians of 25, interleaved, two runs): 1 row 3.48 → 3.04
    and 3.21 → 2.93, 2 rows 3.94 → 3.41 and 3.52 → 3.14, 3 rows 4.30 → 3.81 and 3.90 → 3.40; 4 rows (1 → 3 panels)
    4.24 → 3.80 and 4.28 → 4.13. Four panels for one row measured slower than three (3.39, 3.17), two panels for
    5–8 rows slower than one (LLVM spills accumulators from 6 rows on)."""
    if width >= 16:
        return 3 if rows <= 4 else 1
    return 2 if rows <= 3 else 1


def _panel_loop(form: str, tag: str, rows: int, together: int, width: int, prefetch: int, edges: tuple) -> list[str]:
    """IR blocks `{tag}panel`… computing `together` panels per iteration for b = first, first + together, … < end;
    `edges` = (block it is entered from, first, end, block to branch to when done)."""
    enter, first, end, leave = edges
    vec = f"<{width} x float>"
    out = [f"{tag}panel:\n  %{tag}b = phi i64 [{first}, %{enter}], [%{tag}b_next, %{tag}store]",
           f"  %{tag}done = icmp sge i64 %{tag}b, {end}\n  br i1 %{tag}done, label %{leave}, label %{tag}start",
           f"{tag}start:\n  br label %{tag}loop",
           f"{tag}loop:\n  %{tag}t = phi i64 [0, %{tag}start], [%{tag}t_next, %{tag}loop]"]
    out += [f"  %{tag}a{c}_{m}_0 = phi {vec} [zeroinitializer, %{tag}start], [%{tag}a{c}_{m}_8, %{tag}loop]"
            for c in range(together) for m in range(rows)]
    out.append(f"  %{tag}rec = lshr i64 %{tag}t, 2\n  %{tag}g = and i64 %{tag}t, 3\n  %{tag}k0 = mul i64 %{tag}t, 8")
    if form in FOUR_BIT:  # the group's code lanes: after d and m (2 or 1 words a column), 4·P bytes a group
        head = 4 * width * (RECORD_FLOATS[form] - 4)
        out.append(f"  %{tag}goff = mul i64 %{tag}g, {4 * width}\n  %{tag}gcodes = add i64 %{tag}goff, {head}")
    else:  # the group's first step of codes: after d, P bytes a step
        out.append(f"  %{tag}goff = mul i64 %{tag}g, {8 * width}\n  %{tag}gcodes = add i64 %{tag}goff, {4 * width}")
    for c in range(together):
        out += _record_loads(form, f"%{tag}{c}", f"%{tag}", c, width, prefetch)
    for i in range(8):
        out += _step(form, tag, i, rows, together, width)
    out.append(f"  %{tag}t_next = add i64 %{tag}t, 1\n  %{tag}last = icmp eq i64 %{tag}t_next, %groups")
    out.append(f"  br i1 %{tag}last, label %{tag}store, label %{tag}loop\n{tag}store:")
    out += _stores(tag, rows, together, width)
    out.append(f"  %{tag}b_next = add i64 %{tag}b, {together}\n  br label %{tag}panel")
    return out


def _record_loads(form: str, p: str, t: str, c: int, width: int, prefetch: int) -> list[str]:
    """Panel b + c's record for this group of 8 steps: its scales `{p}d` and, for "affine4", offsets `{p}m` and
    the group's code lanes `{p}codes` ("scaled8": `{p}np` points at the group's first step of codes); a prefetch
    ahead."""
    vec = f"<{width} x float>"
    out = [f"  {p}b = add i64 {t}b, {c}\n  {p}base = mul i64 {p}b, %records\n  {p}ri = add i64 {p}base, {t}rec",
           f"  {p}roff = mul i64 {p}ri, {4 * width * RECORD_FLOATS[form]}",
           f"  {p}rp = getelementptr i8, ptr %w, i64 {p}roff"]
    if form == "affine4h":  # one word a column: d in its low half, m in its high half, both float16
        out += [f"  {p}dm = load <{width} x i32>, ptr {p}rp, align 4", *widen_halves(p, width)]
    else:
        out.append(f"  {p}d = load {vec}, ptr {p}rp, align 4")
    if form == "affine4":
        out.append(f"  {p}mp = getelementptr i8, ptr {p}rp, i64 {4 * width}\n  {p}m = load {vec}, ptr {p}mp, align 4")
    if form in FOUR_BIT:
        out += [f"  {p}np = getelementptr i8, ptr {p}rp, i64 {t}gcodes",
                f"  {p}codes = load <{width} x i32>, ptr {p}np, align 4"]
    else:
        out.append(f"  {p}np = getelementptr i8, ptr {p}rp, i64 {t}gcodes")
    return out + [f"  {p}ahead = getelementptr i8, ptr {p}np, i64 {prefetch * width * 4}",
                  f"  call void @llvm.prefetch.p0(ptr {p}ahead, i32 0, i32 3, i32 1)"]


def widen_halves(p: str, width: int) -> list[str]:
    """IR widening the float16 halves of the `width` 32-bit lanes `{p}dm` to float32 (exact): the low halves to
    `{p}d`, the high halves to `{p}m` (an "affine4h" record's scales and offsets)."""
    lanes, halves, vec = f"<{width} x i32>", f"<{width} x i16>", f"<{width} x float>"
    return [f"  {p}dh = trunc {lanes} {p}dm to {halves}\n  {p}dhf = bitcast {halves} {p}dh to <{width} x half>",
            f"  {p}d = fpext <{width} x half> {p}dhf to {vec}",
            f"  {p}mw = lshr {lanes} {p}dm, {splat_const(16, width, 'i32')}",
            f"  {p}mh = trunc {lanes} {p}mw to {halves}",
            f"  {p}mhf = bitcast {halves} {p}mh to <{width} x half>",
            f"  {p}m = fpext <{width} x half> {p}mhf to {vec}"]


def _weight(form: str, p: str, i: int, width: int) -> list[str]:
    """Rebuild panel `p`'s weight vector `{p}w{i}` of step 8t + i: fma(q, d, m) from 4-bit codes ("affine4") or
    d · q from 8-bit codes ("scaled8"); both exact (see the module docstring)."""
    vec, lanes = f"<{width} x float>", f"<{width} x i32>"
    if form == "scaled8":
        return [f"  {p}cp{i} = getelementptr i8, ptr {p}np, i64 {i * width}",
                f"  {p}c{i} = load <{width} x i8>, ptr {p}cp{i}, align 1",
                f"  {p}q{i} = sext <{width} x i8> {p}c{i} to {lanes}",
                f"  {p}qf{i} = sitofp {lanes} {p}q{i} to {vec}\n  {p}w{i} = fmul {vec} {p}qf{i}, {p}d"]
    out, shifted = [], f"{p}codes"
    if i:
        shifted = f"{p}sh{i}"
        out.append(f"  {shifted} = lshr {lanes} {p}codes, {splat_const(4 * i, width, 'i32')}")
    return out + [f"  {p}q{i} = and {lanes} {shifted}, {splat_const(15, width, 'i32')}",
                  f"  {p}qf{i} = sitofp {lanes} {p}q{i} to {vec}",
                  f"  {p}w{i} = call {vec} @llvm.fma.v{width}f32({vec} {p}qf{i}, {vec} {p}d, {vec} {p}m)"]


def _step(form: str, tag: str, i: int, rows: int, together: int, width: int) -> list[str]:
    """Step 8t + i: broadcast each row's input, rebuild each panel's weight vector, one multiply-add per row."""
    vec, fma = f"<{width} x float>", f"@llvm.fma.v{width}f32"
    out = [f"  %{tag}k{i}_ = add i64 %{tag}k0, {i}\n  %{tag}xk{i} = mul i64 %{tag}k{i}_, %xs",
           f"  %{tag}xrow{i} = getelementptr float, ptr %x, i64 %{tag}xk{i}"]
    for m in range(rows):
        x = f"%{tag}x{i}_{m}"
        out += [f"  {x}p = getelementptr float, ptr %{tag}xrow{i}, i64 {m}\n  {x}s = load float, ptr {x}p, align 4",
                f"  {x}h = insertelement {vec} poison, float {x}s, i32 0",
                f"  {x} = shufflevector {vec} {x}h, {vec} poison, <{width} x i32> zeroinitializer"]
    for c in range(together):
        p = f"%{tag}{c}"
        out += _weight(form, p, i, width)
        out += [f"  %{tag}a{c}_{m}_{i + 1} = call {vec} {fma}({vec} %{tag}x{i}_{m}, {vec} {p}w{i}, "
                f"{vec} %{tag}a{c}_{m}_{i})" for m in range(rows)]
    return out


def _stores(tag: str, rows: int, together: int, width: int) -> list[str]:
    """Store every panel's row sums into y [rows, N] at the panel's columns."""
    return store_sums(tag, rows, together, width, lambda c: f"%{tag}{c}b", lambda c, m: f"%{tag}a{c}_{m}_8")


def store_sums(tag: str, rows: int, together: int, width: int, panel, total) -> list[str]:
    """IR storing `together` panels' row sums into y [rows, N] at each panel's columns: `panel(c)` names the
    index of panel c, `total(c, m)` its sum vector of row m (values named after `tag`)."""
    out = []
    for c in range(together):
        out.append(f"  %{tag}col{c} = mul i64 {panel(c)}, {width}")
        for m in range(rows):
            y = f"%{tag}y{c}_{m}"
            out += [f"  {y}r = mul i64 %N, {m}\n  {y}i = add i64 {y}r, %{tag}col{c}",
                    f"  {y}p = getelementptr float, ptr %y, i64 {y}i",
                    f"  store <{width} x float> {total(c, m)}, ptr {y}p, align 4"]
    return out


def _splat(width: int, value: int) -> str:
    """An IR constant vector of `width` i32 lanes, each `value`."""
    return "<" + ", ".join([f"i32 {value}"] * width) + ">"
