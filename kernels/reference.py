"""Plain-PyTorch tree attention: the ground truth for the Triton kernel and the CPU implementation."""

from __future__ import annotations

import torch


def check_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree_mask: torch.Tensor
) -> tuple[int, int, int, int, int, int]:
    """Check the shape contract shared by the reference and the kernel.

    Args:
        q: `[B, H, T, D]` queries of the T tree rows.
        k, v: `[B, H_kv, S, D]` keys/values, `S = prefix_len + T`; the last T rows belong to the T queries.
        tree_mask: `[T, T]` or `[B, T, T]` bool, True where row i may attend to tree row j.

    Returns:
        `(B, H, H_kv, T, S, D)`.

    Raises:
        ValueError: a wrong rank, mismatched batch/heads/head size/length, or a non-bool tree mask.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4D [B, heads, len, D], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    B, H, T, D = q.shape
    _, H_kv, S, _ = k.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} in batch or head size")
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({H_kv})")
    if T == 0 or S < T:
        raise ValueError(f"k/v length S={S} must be >= the number of tree rows T={T} >= 1")
    if tree_mask.dtype != torch.bool:
        raise ValueError(f"tree_mask must be a bool tensor, got {tree_mask.dtype}")
    if tree_mask.shape not in ((T, T), (B, T, T)):
        raise ValueError(f"tree_mask must be [T, T] or [B, T, T] with B={B}, T={T}, got {tuple(tree_mask.shape)}")
    return B, H, H_kv, T, S, D


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree_mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Attention of T tree rows over a fully visible prefix and a tree-masked T x T block.

    Row i attends to every prefix position and to tree row j where `tree_mask[..., i, j]` is True; the
    diagonal is always allowed, whatever the mask says. Scores and softmax are computed in fp32.

    Args:
        q: `[B, H, T, D]`; k, v: `[B, H_kv, S, D]` with `S = prefix_len + T` and `H % H_kv == 0` (GQA).
        tree_mask: `[T, T]` or `[B, T, T]` bool.
        scale: score scale, default `D ** -0.5`.

    Returns:
        `[B, H, T, D]` in q's dtype.

    Raises:
        ValueError: see `check_shapes`.
    """
    B, H, H_kv, T, S, D = check_shapes(q, k, v, tree_mask)
    scale = D**-0.5 if scale is None else scale
    group = H // H_kv
    kf = k.float().repeat_interleave(group, dim=1)  # [B, H, S, D]
    vf = v.float().repeat_interleave(group, dim=1)  # [B, H, S, D]
    scores = q.float() @ kf.transpose(-1, -2) * scale  # [B, H, T, S]
    diagonal = torch.eye(T, dtype=torch.bool, device=q.device)
    visible = (tree_mask | diagonal).expand(B, T, T)  # [B, T, T]
    tree_scores = scores[..., S - T :].masked_fill(~visible[:, None], float("-inf"))  # [B, H, T, T]
    scores = torch.cat([scores[..., : S - T], tree_scores], dim=-1)  # [B, H, T, S]
    return (scores.softmax(dim=-1) @ vf).to(q.dtype)  # [B, H, T, D]
