"""Attention backend for the verification forward, registered through transformers' `AttentionInterface`.

`register()` adds `lookahead_tree`: on CUDA, a forward of 2..64 new rows whose 4D mask shows every row the whole
cached prefix (the verification step) runs the Triton tree kernel with the mask's last T columns as the tree;
everything else (prefill, single-token decode, padded batches, CPU) runs transformers' own SDPA attention
unchanged. Both compute the same attention, so choosing between them never changes what the model means.
Triton is imported only on the kernel path, so the CPU path works without it.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "lookahead_tree"

# Take the kernel path for CPU tensors too. Only meaningful while Triton interprets the kernel
# (TRITON_INTERPRET=1); tests set it to check the kernel path against SDPA without a GPU.
FORCE_KERNEL = False

# Attention features the kernel does not implement; a layer asking for one always runs SDPA.
_KERNEL_UNSUPPORTED_KWARGS = ("softcap", "position_bias", "s_aux")


def register() -> str:
    """Register `lookahead_tree` as an attention function and, reusing sdpa's, as a mask function (idempotent).

    Returns:
        The name to give as `attn_implementation` (e.g. `model.set_attn_implementation(register())`).
    """
    AttentionInterface.register(NAME, tree_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: the Triton tree kernel for verification forwards, SDPA otherwise.

    Args:
        module: the calling attention layer (passed on to SDPA).
        query: `[B, H, T, D]`; key, value: `[B, H_kv, S, D]`, `S = prefix_len + T`, the new rows last.
        attention_mask: None or `[B, 1, T, S]`, additive float (0 = attend, dtype min or -inf = blocked) or bool
            (True = attend). The kernel runs only if every row sees all `prefix_len` columns and itself.
        dropout, scaling, kwargs: as for `transformers.integrations.sdpa_attention.sdpa_attention_forward`.

    Returns:
        `([B, T, H, D] attention output, None)`, like SDPA.
    """
    tree_mask = _kernel_tree_mask(query, key, attention_mask) if _kernel_eligible(query, dropout, kwargs) else None
    if tree_mask is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    from lookahead.kernels import tree_attention

    out = tree_attention(query.contiguous(), key.contiguous(), value.contiguous(), tree_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None  # [B, T, H, D]


def _kernel_eligible(query: torch.Tensor, dropout: float, kwargs: dict) -> bool:
    """Whether the kernel can compute this call, judged from everything but the mask."""
    if not (query.is_cuda or FORCE_KERNEL) or dropout:
        return False
    if any(kwargs.get(name) is not None for name in _KERNEL_UNSUPPORTED_KWARGS):
        return False
    from lookahead.kernels.tree_attention import DTYPES, HEAD_DIMS, MAX_TREE_TOKENS

    _, _, T, D = query.shape
    return 1 < T <= MAX_TREE_TOKENS and D in HEAD_DIMS and query.dtype in DTYPES


def _kernel_tree_mask(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """The bool tree block (`[T, T]` or `[B, T, T]`) if `attention_mask` is a verification mask, else None."""
    T, S = query.shape[2], key.shape[2]
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        return None
    if attention_mask.shape[-2:] != (T, S) or attention_mask.shape[0] not in (1, query.shape[0]):
        return None
    return _TREE_BLOCKS.get(attention_mask, S - T)


class _TreeBlockCache:
    """The tree block of the last mask seen. Every layer of a forward gets the same mask tensor, and checking
    it costs a device-to-host sync, which should happen once per forward rather than once per layer."""

    def __init__(self) -> None:
        # (mask, (mask version, prefix_len), block), replaced whole so concurrent forwards never mix entries. The
        # mask is held so that its id cannot be reused; it is at most [B, 1, 64, S].
        self._entry: tuple[torch.Tensor, tuple[int, int], torch.Tensor | None] | None = None

    def get(self, mask: torch.Tensor, prefix_len: int) -> torch.Tensor | None:
        """`mask[:, 0, :, prefix_len:]` as bool (batch dim dropped if 1), or None unless every row sees the
        whole prefix and itself and a float mask holds only 0 and blocked values."""
        key = (mask._version, prefix_len)
        entry = self._entry
        if entry is None or entry[0] is not mask or entry[1] != key:
            entry = self._entry = (mask, key, _tree_block(mask, prefix_len))
        return entry[2]


_TREE_BLOCKS = _TreeBlockCache()


def _tree_block(mask: torch.Tensor, prefix_len: int) -> torch.Tensor | None:
    """See `_TreeBlockCache.get`; `mask` is `[B, 1, T, S]`."""
    if mask.dtype == torch.bool:
        visible, well_formed = mask, True
    else:
        visible = mask == 0
        well_formed = (visible | (mask <= torch.finfo(mask.dtype).min)).all()
    tree = visible[:, 0, :, prefix_len:]  # [B, T, T]
    usable = visible[..., :prefix_len].all() & tree.diagonal(dim1=-2, dim2=-1).all() & well_formed
    if not usable:
        return None
    return tree[0] if tree.shape[0] == 1 else tree
