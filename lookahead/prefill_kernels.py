"""The element-wise parts of a prompt's prefill, compiled: RMS norms (with the residual add before the second),
RoPE and SiLU gating over many rows, split between the threads.

`lean_layers` runs a layer's norms, RoPE, SiLU and residual adds as PyTorch operations, one pass over the rows
each: ~8 for a norm, ~5 for RoPE, a copy, SiLU and a product for the gating. On a prompt's rows those passes were
~20% of the prefill (a 660-token prompt of the default model, Intel Xeon, 2 threads: ~120 ms of PyTorch element-wise
time in a ~600 ms prefill, its products on the AMX kernel; a 3000-token prompt ~0.8 s of ~4.1 s). Here each runs as
one compiled pass per row, the rows split between the threads. What they compute:

- `rms_norm` / `add_rms_norm`: weight · (x · 1/√(Σx²/width + eps)), the sum of squares vectorised (its own order,
  so the last bits can differ from PyTorch's); `add_rms_norm` first adds the residual in place (exact, as `add_`);
- `rope`: x · cos + roll(x, D/2) · folded sin, two rounded products and a rounded sum as `lean_layers._rope`
  computes them (bit for bit the same), written as [heads, rows, D];
- `silu_times`: gate / (1 + e^-gate) · up, e^-gate by Cephes' single-precision formula (`vector_ir`: within ~1 ulp
  of the exact value, as PyTorch's own vectorised exp), e^-gate's argument clamped to [-87, 88] (SiLU's value there
  is gate itself or 0 to float32's precision).

The logits move in the last bits, as with any change of kernel; greedy outputs are tested against plain greedy.
`lean_layers` calls these for a prefill of one sequence of at least `ROWS` rows in float32 (`applies`).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from .fused_kernels import exp_parts
from .thread_governor import numba_threads
from .vector_ir import EXP_FLOOR

ROWS = 64  # rows from which a forward's element-wise parts run here (decode steps keep their own paths)
EXP_CEILING = np.float32(88.0)  # e^88 is below float32's largest value; SiLU's exp argument is clamped here
_REDUCE = {"reassoc", "nsz", "contract"}


def applies(hidden: torch.Tensor) -> bool:
    """Whether a layer's input `hidden` [B, T, size] is one whose element-wise parts run here: one sequence of at
    least ROWS rows, float32, contiguous."""
    return (hidden.dim() == 3 and hidden.shape[0] == 1 and hidden.shape[1] >= ROWS and hidden.dtype == torch.float32
            and hidden.is_contiguous() and not hidden.requires_grad)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The RMS norm of x [..., size] (contiguous float32) with weight [size] and eps (a float32 scalar tensor)."""
    return _normed(x, _empty_rows(), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """x += residual in place (both [..., size], contiguous float32), then the RMS norm of x."""
    return _normed(x, residual.view(-1, residual.shape[-1]).numpy(), weight, eps)


def _normed(x: torch.Tensor, residual: np.ndarray, weight: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """`_norm_rows` of x's rows (after adding residual's rows, if any) into a new tensor shaped as x."""
    out = torch.empty_like(x)
    rows = x.numel() // x.shape[-1]
    _norm_rows(x.view(rows, -1).numpy(), residual, weight.detach().numpy(), np.float32(float(eps)), _threads(),
               out.view(rows, -1).numpy())
    return out


def rope(states: torch.Tensor, heads: int, cos: torch.Tensor, folded_sin: torch.Tensor) -> torch.Tensor:
    """RoPE of the first `heads` heads of states [1, T, ≥ heads · D] (rows of any stride, each row's elements
    contiguous) with cos and folded sin [T, D]: [1, heads, T, D], contiguous."""
    rows, head_dim = cos.shape
    flat, stride = _flat_rows(states[0])
    out = torch.empty(1, heads, rows, head_dim)
    _rope_rows(flat, stride, heads, cos.contiguous().numpy(), folded_sin.contiguous().numpy(), _threads(),
               out[0].numpy())
    return out


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for gate and up [1, T, I] (rows of any stride, each row's elements contiguous): [1, T, I]."""
    rows, width = gate.shape[1], gate.shape[2]
    gates, gate_stride = _flat_rows(gate[0])
    ups, up_stride = _flat_rows(up[0])
    out = torch.empty(1, rows, width)
    _silu_rows(gates, gate_stride, ups, up_stride, _threads(), out[0].numpy())
    return out


def _threads() -> int:
    """The numba threads that go with torch's thread count now."""
    return numba_threads(torch.get_num_threads())


def _empty_rows() -> np.ndarray:
    """A [0, 0] array: no residual to add."""
    return np.empty((0, 0), np.float32)


def _flat_rows(rows: torch.Tensor) -> tuple[np.ndarray, int]:
    """(a 1-D float32 array from the first element of rows [T, W] to its last, the row stride) for a 2-D view
    whose rows each hold W contiguous elements. Raises `ValueError` otherwise."""
    if rows.dtype != torch.float32 or rows.dim() != 2 or rows.stride(1) != 1:
        raise ValueError(f"prefill_kernels needs float32 rows of contiguous elements, got {rows.dtype} "
                         f"{tuple(rows.shape)} strides {rows.stride()}")
    count, width = rows.shape
    stride = rows.stride(0)
    span = (count - 1) * stride + width
    return rows.as_strided((span,), (1,)).numpy(), stride


@numba.njit(parallel=True, nogil=True, cache=True)
def _norm_rows(x, residual, weight, eps, threads, out):  # pragma: no cover - compiled
    """out[r] = the RMS norm of x[r] for every row of x [rows, size], after x[r] += residual[r] when residual has
    rows; the rows split into `threads` contiguous ranges."""
    rows, size = x.shape
    width = np.float32(size)
    for t in numba.prange(threads):
        for r in range(t * rows // threads, (t + 1) * rows // threads):
            if residual.shape[0]:
                _add_row(x[r], residual[r])
            _norm_row(x[r], weight, eps, width, out[r])


@numba.njit(nogil=True, cache=True)
def _add_row(x, residual):  # pragma: no cover - compiled
    """x += residual, element by element."""
    for i in range(x.shape[0]):
        x[i] += residual[i]


@numba.njit(nogil=True, cache=True, fastmath=_REDUCE, error_model="numpy")
def _norm_row(x, weight, eps, width, out):  # pragma: no cover - compiled
    """out = (x · 1/√(Σx²/width + eps)) · weight; the sum vectorised."""
    total = np.float32(0.0)
    for i in range(x.shape[0]):
        total += x[i] * x[i]
    inverse = np.float32(1.0) / np.sqrt(total / width + eps)
    for i in range(x.shape[0]):
        out[i] = (x[i] * inverse) * weight[i]


@numba.njit(parallel=True, nogil=True, cache=True)
def _rope_rows(flat, stride, heads, cos, folded_sin, threads, out):  # pragma: no cover - compiled
    """out[h, t] = RoPE of head h of row t (its D elements at flat[t · stride + h · D]) with cos[t], folded_sin[t],
    for out [heads, rows, D]; the rows split into `threads` contiguous ranges."""
    rows, head_dim = cos.shape
    half = head_dim // 2
    for th in numba.prange(threads):
        for t in range(th * rows // threads, (th + 1) * rows // threads):
            for h in range(heads):
                base = t * stride + h * head_dim
                x = flat[base:base + head_dim]
                for i in range(half):  # roll(x, D/2): the first half's partner is D/2 further, the second's before
                    out[h, t, i] = x[i] * cos[t, i] + x[i + half] * folded_sin[t, i]
                for i in range(half, head_dim):
                    out[h, t, i] = x[i] * cos[t, i] + x[i - half] * folded_sin[t, i]


@numba.njit(parallel=True, nogil=True, cache=True)
def _silu_rows(gates, gate_stride, ups, up_stride, threads, out):  # pragma: no cover - compiled
    """out[t] = silu(gate row t) · up row t for out [rows, I], the rows at gates[t · gate_stride] and
    ups[t · up_stride]; the rows split into `threads` contiguous ranges, each with its own scratch."""
    rows, width = out.shape
    for th in numba.prange(threads):
        polynomial = np.empty(width, np.float32)
        powers = np.empty(width, np.float32)
        for t in range(th * rows // threads, (th + 1) * rows // threads):
            gate = gates[t * gate_stride:t * gate_stride + width]
            _exp_negated(gate, polynomial, powers)
            _gate_row(gate, ups[t * up_stride:t * up_stride + width], polynomial, powers, out[t])


@numba.njit(nogil=True, cache=True, fastmath={"contract"})
def _exp_negated(x, polynomial, powers):  # pragma: no cover - compiled
    """e^-x[i] as polynomial[i] · powers[i] (Cephes' formula, `vector_ir`), the argument clamped to
    [EXP_FLOOR, EXP_CEILING]; powers holds the powers of two written into their exponent bits."""
    bits = powers.view(np.int32)
    for i in range(x.shape[0]):
        polynomial[i], n = exp_parts(min(max(-x[i], EXP_FLOOR), EXP_CEILING))
        bits[i] = (n + np.int32(127)) << 23


@numba.njit(nogil=True, cache=True, error_model="numpy")  # no division check: the loop vectorises
def _gate_row(gate, up, polynomial, powers, out):  # pragma: no cover - compiled
    """out = gate / (1 + e^-gate) · up, with e^-gate = polynomial · powers: rounded as PyTorch's SiLU and product."""
    for i in range(out.shape[0]):
        out[i] = (gate[i] / (np.float32(1.0) + polynomial[i] * powers[i])) * up[i]
