"""Compiled inner loops of the fused step's attention (`fused_kernels.attend`): one query's scores over the cached
keys, and one query's weighted sum of the cached values, as LLVM IR for vectors of 8 floats.

numba compiled them as a dot product per key (a horizontal sum each) and a weighted sum with its accumulators in
memory: ~25% of the FMA units' pace. Here `dots` keeps the query in registers and scores 8 keys at once (8
independent multiply-add chains, one per key, then one tree of shuffles and adds turns the 8 accumulators into the
8 scores), and `weighted` keeps the output in registers across the keys. Every score and every output is summed
in an order fixed by the head size and the key's own slot (never by how many keys or rows the step has):

- a key's score: per lane l of the head's 8-float vectors v = 0…V-1, the chain q₀k₀ then fma(q_v, k_v, ·); then the
  lanes as ((l₀ + l₁) + (l₂ + l₃)) + ((l₄ + l₅) + (l₆ + l₇)); then × scale (a key past the last block of 8 goes
  through the very same operations one by one);
- an output element: the keys' multiply-adds in slot order within each of `chains` sets (slot s in set s mod
  chains: with few vectors per head, more independent chains keep the FMA units busy), then the sets added in order.

The head size must be a multiple of 8 (`supports`); other models attend with numba's loops.
"""

from __future__ import annotations

import functools

from numba import types as nb_types
from numba.extending import intrinsic

from .compiled_ir import call_codegen, compiled_addresses
from .vector_ir import Width, chain, pairwise

LANES = 8
VEC = f"<{LANES} x float>"
_WIDTH = Width(LANES)


def supports(head_dim: int) -> bool:
    """Whether the compiled loops take heads of this size (whole vectors of 8 floats)."""
    return head_dim > 0 and head_dim % LANES == 0


@functools.cache
def attention_addresses(head_dim: int) -> tuple[int, int]:
    """Addresses of the compiled `dots(q, keys, count, out, scale)` and `weighted(w, values, count, out)` for
    heads of `head_dim` floats (compiled on first use, or loaded from the disk cache)."""
    if not supports(head_dim):
        raise ValueError(f"the compiled attention takes heads of a multiple of {LANES} floats, got {head_dim}")
    ir = module_ir(head_dim)
    return compiled_addresses(ir, ("dots", "weighted"), f"attention-{head_dim}")


def module_ir(head_dim: int) -> str:
    """The LLVM module: `dots` and `weighted` for heads of `head_dim` floats."""
    declarations = [f"declare {VEC} @llvm.fma.v{LANES}f32({VEC}, {VEC}, {VEC})"]
    return "\n".join(declarations + [dots_ir(head_dim), weighted_ir(head_dim)])


def dots_ir(head_dim: int) -> str:
    """`void dots(i64 q, i64 keys, i64 count, i64 out, float scale)`: out[s] = (q · keys[s]) · scale for the
    `count` keys at `keys` ([count, head_dim] floats), summed as the module docstring says."""
    vectors, out = head_dim // LANES, []
    emit = out.append
    emit("define void @dots(i64 %qa, i64 %ka, i64 %count, i64 %oa, float %scale) {")
    emit("entry:\n  %q = inttoptr i64 %qa to ptr\n  %keys = inttoptr i64 %ka to ptr\n  %out = inttoptr i64 %oa to ptr")
    for v in range(vectors):
        emit(f"  %qp{v} = getelementptr float, ptr %q, i64 {v * LANES}\n  %q{v} = load {VEC}, ptr %qp{v}, align 4")
    emit(f"  %sh = insertelement {VEC} poison, float %scale, i32 0")
    emit(f"  %scales = shufflevector {VEC} %sh, {VEC} poison, <{LANES} x i32> zeroinitializer")
    emit(f"  %blocks_end = and i64 %count, -{LANES}\n  br label %block_test")
    emit("block_test:\n  %s = phi i64 [0, %entry], [%s_next, %block]\n  %more = icmp slt i64 %s, %blocks_end")
    emit("  br i1 %more, label %block, label %tail_test")
    emit("block:")
    for j in range(LANES):
        emit(f"  %slot{j} = add i64 %s, {j}\n  %off{j} = mul i64 %slot{j}, {head_dim}")
        emit(f"  %kp{j} = getelementptr float, ptr %keys, i64 %off{j}")
        out += chain(_WIDTH, f"c{j}", "q", f"kp{j}", vectors)
    for j in range(0, LANES, 2):
        out += pairwise(_WIDTH, f"r1_{j}", f"c{j}", f"c{j + 1}")
    out += pairwise(_WIDTH, "r2_0", "r1_0", "r1_2")
    out += pairwise(_WIDTH, "r2_4", "r1_4", "r1_6")
    out += pairwise(_WIDTH, "r3", "r2_0", "r2_4")
    emit(f"  %scaled = fmul {VEC} %r3, %scales\n  %op = getelementptr float, ptr %out, i64 %s")
    emit(f"  store {VEC} %scaled, ptr %op, align 4\n  %s_next = add i64 %s, {LANES}\n  br label %block_test")
    emit("tail_test:\n  %t = phi i64 [%blocks_end, %block_test], [%t_next, %tail]\n  %left = icmp slt i64 %t, %count")
    emit("  br i1 %left, label %tail, label %exit")
    emit(f"tail:\n  %toff = mul i64 %t, {head_dim}\n  %tkp = getelementptr float, ptr %keys, i64 %toff")
    out += chain(_WIDTH, "u", "q", "tkp", vectors)
    out += pairwise(_WIDTH, "u1", "u", "u")  # lanes [u01, u23, u45, u67, …]: the same tree as a block's, one key
    out += pairwise(_WIDTH, "u2", "u1", "u1")  # [u0123, u4567, …]
    out += pairwise(_WIDTH, "u3", "u2", "u2")  # [u01234567, …]
    emit(f"  %dot = extractelement {VEC} %u3, i32 0\n  %score = fmul float %dot, %scale")
    emit("  %tp = getelementptr float, ptr %out, i64 %t\n  store float %score, ptr %tp, align 4")
    emit("  %t_next = add i64 %t, 1\n  br label %tail_test")
    emit("exit:\n  ret void\n}")
    return "\n".join(out)


def weighted_ir(head_dim: int) -> str:
    """`void weighted(i64 w, i64 values, i64 count, i64 out)`: out[i] = Σ_s w[s] · values[s, i] over the `count`
    values at `values` ([count, head_dim] floats), summed as the module docstring says."""
    vectors = head_dim // LANES
    chains = max(1, LANES // vectors)  # sets of accumulators: at least 8 independent chains in all
    out = []
    emit = out.append
    emit("define void @weighted(i64 %wa, i64 %va, i64 %count, i64 %oa) {")
    emit("entry:\n  %w = inttoptr i64 %wa to ptr\n  %values = inttoptr i64 %va to ptr")
    emit("  %out = inttoptr i64 %oa to ptr")
    emit(f"  %groups_end = sub i64 %count, {chains - 1}\n  br label %group_test")
    emit("group_test:\n  %s = phi i64 [0, %entry], [%s_next, %group]")
    _phis(emit, chains, vectors, "acc", "entry", "next", "group")
    emit("  %more = icmp slt i64 %s, %groups_end\n  br i1 %more, label %group, label %tail_test")
    emit("group:")
    for c in range(chains):
        _accumulate(emit, "%s", c, vectors, head_dim, f"g{c}", "acc", "next")
    emit(f"  %s_next = add i64 %s, {chains}\n  br label %group_test")
    emit("tail_test:\n  %t = phi i64 [%s, %group_test], [%t_next, %tail]")
    _phis(emit, chains, vectors, "tacc", "group_test", "tnext", "tail", first="acc")
    emit("  %left = icmp slt i64 %t, %count\n  br i1 %left, label %tail, label %finish")
    emit("tail:")  # the last count mod chains keys, slot t into set t - s (= t mod chains)
    emit("  %set = sub i64 %t, %s")
    for c in range(chains):
        emit(f"  %is{c} = icmp eq i64 %set, {c}")
    _accumulate(emit, "%t", 0, vectors, head_dim, "tk", "tacc", "tnext", sets=chains)
    emit("  %t_next = add i64 %t, 1\n  br label %tail_test")
    emit("finish:")
    for v in range(vectors):
        total = f"%tacc0_{v}"
        for c in range(1, chains):
            emit(f"  %fin{c}_{v} = fadd {VEC} {total}, %tacc{c}_{v}")
            total = f"%fin{c}_{v}"
        emit(f"  %outp{v} = getelementptr float, ptr %out, i64 {v * LANES}")
        emit(f"  store {VEC} {total}, ptr %outp{v}, align 4")
    emit("  ret void\n}")
    return "\n".join(out)


def _phis(emit, chains: int, vectors: int, name: str, start: str, update: str, loop: str, first: str = "") -> None:
    """IR phis %{name}{c}_{v}: from block `start` zero (or %{first}{c}_{v}), from block `loop` %{update}{c}_{v}."""
    for c in range(chains):
        for v in range(vectors):
            initial = f"%{first}{c}_{v}" if first else "zeroinitializer"
            emit(f"  %{name}{c}_{v} = phi {VEC} [{initial}, %{start}], [%{update}{c}_{v}, %{loop}]")


def _accumulate(emit, slot: str, c: int, vectors: int, head_dim: int, tag: str, acc: str, result: str,
                sets: int = 0) -> None:
    """IR: %{result}{c}_{v} = fma(w[slot + c], values[slot + c, v], %{acc}{c}_{v}) for every vector v; with `sets`,
    the one key at `slot` goes into the set %is{k} selects and every other set keeps its value."""
    emit(f"  %{tag}_slot = add i64 {slot}, {c}\n  %{tag}_wp = getelementptr float, ptr %w, i64 %{tag}_slot")
    emit(f"  %{tag}_w = load float, ptr %{tag}_wp, align 4")
    emit(f"  %{tag}_wh = insertelement {VEC} poison, float %{tag}_w, i32 0")
    emit(f"  %{tag}_ws = shufflevector {VEC} %{tag}_wh, {VEC} poison, <{LANES} x i32> zeroinitializer")
    emit(f"  %{tag}_off = mul i64 %{tag}_slot, {head_dim}")
    for v in range(vectors):
        emit(f"  %{tag}_i{v} = add i64 %{tag}_off, {v * LANES}")
        emit(f"  %{tag}_vp{v} = getelementptr float, ptr %values, i64 %{tag}_i{v}")
        emit(f"  %{tag}_v{v} = load {VEC}, ptr %{tag}_vp{v}, align 4")
        for k in range(sets) if sets else (c,):
            fused = f"{tag}_f{k}_{v}" if sets else f"{result}{k}_{v}"
            emit(f"  %{fused} = call {VEC} @llvm.fma.v{LANES}f32({VEC} %{tag}_ws, {VEC} %{tag}_v{v}, "
                 f"{VEC} %{acc}{k}_{v})")
            if sets:
                emit(f"  %{result}{k}_{v} = select i1 %is{k}, {VEC} %{fused}, {VEC} %{acc}{k}_{v}")


@intrinsic
def call_dots(typingctx, address, q, keys, count, out, scale):
    """Call the compiled `dots` at `address` (numba has no call-by-address): four i64 arguments and a float."""
    return nb_types.void(*([nb_types.int64] * 5), nb_types.float32), call_codegen(4, with_float=True)


@intrinsic
def call_weighted(typingctx, address, w, values, count, out):
    """Call the compiled `weighted` at `address` with four i64 arguments."""
    return nb_types.void(*([nb_types.int64] * 5)), call_codegen(4)

