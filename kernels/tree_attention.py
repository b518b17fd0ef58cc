"""Triton tree attention: T draft rows attend to a cached prefix (no mask) and to each other through a tree mask.

Each program owns BLOCK_M query rows of one (batch, head) and runs one online softmax over two stages: stage 1
streams the prefix K/V in BLOCK_N-row blocks with no mask at all; stage 2 walks the T tree rows the same way and
hides scores with a bitmask, one int64 word per query row (bit j = may attend to tree row j). No
`[T, prefix_len + T]` mask exists anywhere.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .reference import check_shapes

MAX_TREE_TOKENS = 64  # one int64 bitmask word per query row
HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two (tl.arange) from tl.dot's minimum up
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_M = 16  # query rows per program
# One K or V tile [BLOCK_N, D]. Compiled for sm_75..sm_90, the kernel then needs at most 48 KB of shared memory
# on sm_75 and 81 KB (fp32, D=256; 25 KB for fp16/bf16) on sm_80 and up, within every GPU's limit.
KV_TILE_BYTES = 16 * 1024
_LOG2E = math.log2(math.e)  # scores go to exp2


@triton.jit
def _online_softmax_step(m_i, l_i, acc, qk, v):
    """Fold one block of scores `qk` [M, N] (log2 units, -inf = hidden) and values `v` [N, D] into the
    running row max `m_i` [M], row sum `l_i` [M] and output `acc` [M, D]. A row that has seen only hidden
    scores so far keeps m = -inf, l = 0, acc = 0."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoids -inf - -inf = NaN
    p = tl.math.exp2(qk - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
    q_ptr,  # [B, H, T, D], contiguous
    k_ptr,  # [B, H_kv, S, D], contiguous
    v_ptr,  # [B, H_kv, S, D], contiguous
    words_ptr,  # [B or 1, T] int64 tree bitmask
    out_ptr,  # [B, H, T, D], contiguous
    qk_scale,  # score scale times log2(e)
    n_heads,
    group_size,  # H // H_kv
    tree_len,  # T
    prefix_len,  # S - T
    words_batch_stride,  # T, or 0 when one mask serves the whole batch
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # >= BLOCK_M
):
    bh = tl.program_id(0)  # b * H + h; the larger grid axis
    batch = bh // n_heads
    kv_bh = batch * (n_heads // group_size) + (bh % n_heads) // group_size
    seq_len = prefix_len + tree_len
    q_base = q_ptr + bh.to(tl.int64) * tree_len * HEAD_DIM
    out_base = out_ptr + bh.to(tl.int64) * tree_len * HEAD_DIM
    k_base = k_ptr + kv_bh.to(tl.int64) * seq_len * HEAD_DIM
    v_base = v_ptr + kv_bh.to(tl.int64) * seq_len * HEAD_DIM

    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < tree_len
    q = tl.load(q_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # Stage 1: the prefix is visible to every row; the bounds check only bites in the last block.
    for start in range(0, prefix_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < prefix_len
        kv_offs = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_base + kv_offs, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + kv_offs, mask=col_ok[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        qk = tl.where(col_ok[None, :], qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, qk, v)

    # Stage 2: the tree block, bit j of a row's word saying whether it sees tree row j. The diagonal is forced
    # on, so every row ends with l > 0; padding rows (offs_m >= T, never stored) too, as their diagonal column
    # lies in the last block (BLOCK_N >= BLOCK_M, both powers of two) and reads k = 0 there.
    words = tl.load(words_ptr + batch * words_batch_stride + offs_m, mask=row_ok, other=0)  # [BLOCK_M] int64
    for start in range(0, tree_len, BLOCK_N):
        offs_t = start + tl.arange(0, BLOCK_N)
        col_ok = offs_t < tree_len
        kv_offs = (prefix_len + offs_t)[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_base + kv_offs, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + kv_offs, mask=col_ok[:, None], other=0.0)
        bits = (words[:, None] >> tl.minimum(offs_t, 63)[None, :]) & 1  # shifts past 63 are undefined
        visible = (col_ok[None, :] & (bits != 0)) | (offs_m[:, None] == offs_t[None, :])
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        qk = tl.where(visible, qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, qk, v)

    out = acc / l_i[:, None]
    out_offs = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(out_base + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree_mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Fused tree attention (Triton); same contract as `lookahead.kernels.reference.tree_attention`.

    Row i attends to all `prefix_len = S - T` prefix positions and to tree row j where
    `tree_mask[..., i, j]` is True; the diagonal is always allowed, whatever the mask says.

    Args:
        q: `[B, H, T, D]` with `1 <= T <= MAX_TREE_TOKENS` and D in `HEAD_DIMS`.
        k, v: `[B, H_kv, S, D]`, `S = prefix_len + T`, `H % H_kv == 0`; the last T rows belong to the queries.
        tree_mask: `[T, T]` or `[B, T, T]` bool.
        scale: score scale, default `D ** -0.5`.

    Returns:
        `[B, H, T, D]` in q's dtype.

    Raises:
        ValueError: wrong ranks or shapes (see `check_shapes`), T or D unsupported, non-contiguous q/k/v,
            tensors on different devices, or CPU tensors while Triton is not interpreting.
        TypeError: q not fp32/fp16/bf16, or k/v of another dtype than q.
    """
    B, H, H_kv, T, S, D = check_shapes(q, k, v, tree_mask)
    _check_kernel_inputs(q, k, v, tree_mask)
    words = _pack_rows(tree_mask)  # [B or 1, T] int64
    scale = D**-0.5 if scale is None else scale
    out = torch.empty_like(q)  # [B, H, T, D]
    on_q_device = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
    with on_q_device:  # Triton launches on the current CUDA device
        _tree_attention_kernel[(B * H, triton.cdiv(T, BLOCK_M))](
            q, k, v, words, out,
            scale * _LOG2E, H, H // H_kv, T, S - T, T if words.shape[0] > 1 else 0,
            HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=key_block_rows(D, q.dtype),
        )  # fmt: skip
    return out


def _check_kernel_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree_mask: torch.Tensor) -> None:
    """Raise for what the kernel cannot take beyond the shared shape contract (see `tree_attention`)."""
    T, D = q.shape[2], q.shape[3]
    if T > MAX_TREE_TOKENS:
        raise ValueError(f"tree_attention supports at most {MAX_TREE_TOKENS} tree rows, got T={T}")
    if D not in HEAD_DIMS:
        raise ValueError(f"tree_attention supports head sizes {HEAD_DIMS}, got D={D}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous() first), got strides {t.stride()}")
    for name, t in (("k", k), ("v", v), ("tree_mask", tree_mask)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if not q.is_cuda and not _interpreting():
        raise ValueError(
            f"tree_attention runs on CUDA tensors, got {q.device}; on CPU use "
            "lookahead.kernels.reference.tree_attention (or, to run this kernel in Triton's interpreter, set "
            "TRITON_INTERPRET=1 before triton is first imported)"
        )


def key_block_rows(head_dim: int, dtype: torch.dtype) -> int:
    """K/V rows per kernel step (BLOCK_N): a KV_TILE_BYTES tile, clamped to [BLOCK_M, 64]; a power of two."""
    return max(BLOCK_M, min(64, KV_TILE_BYTES // (head_dim * dtype.itemsize)))


def _interpreting() -> bool:
    """True when the kernel runs in Triton's CPU interpreter. Triton fixes the mode when a kernel is defined, and
    `tl.zeros`, `tl.max`, ... are kernels too, so TRITON_INTERPRET=1 must precede the first import of triton."""
    return isinstance(_tree_attention_kernel, InterpretedFunction) and isinstance(tl.zeros, InterpretedFunction)


def _pack_rows(tree_mask: torch.Tensor) -> torch.Tensor:
    """`[T, T]` or `[B, T, T]` bool -> `[1, T]` or `[B, T]` int64, bit j of word i = `tree_mask[..., i, j]`.

    Bit 63 lands in the sign bit; the kernel only shifts and masks, so that is harmless.
    """
    T = tree_mask.shape[-1]
    bits = torch.ones(T, dtype=torch.int64, device=tree_mask.device) << torch.arange(T, device=tree_mask.device)
    rows = tree_mask.reshape(-1, T, T).to(torch.int64)  # [B or 1, T, T]
    return (rows * bits).sum(dim=-1).contiguous()  # [B or 1, T]
