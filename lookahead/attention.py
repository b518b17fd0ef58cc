"""Attention backend for the verification forward, registered through transformers' `AttentionInterface`.

`register()` adds `lookahead_tree`: on CUDA, a forward of 2..64 new rows whose 4D mask shows every row the whole
cached prefix (the verification step) runs the Triton tree kernel with the mask's last T columns as the tree. On
the CPU, a masked forward of a grouped-query model (the verification step) runs PyTorch's SDPA with
`enable_gqa=True` instead of transformers' copy of every key/value head per query head (`repeat_kv`), which costs
more than the attention itself at 8–16 rows, and an unmasked one-row forward (plain decoding) makes the very SDPA
call transformers' wrapper would make, without the wrapper's Python. A prompt's causal prefill on an AVX-512 CPU
runs `prefill_attention`'s compiled kernel (~3x PyTorch's CPU flash attention there; the same attention, summed in
another order), and so does the rest of a prompt after a reused cache, within `prompt_after_cache()` (its mask
checked to be the causal one; verification steps never run there, so a draft tree shaped as a chain keeps the
path every other tree takes). Everything else (other prefills, features such as a position bias) runs
transformers' own SDPA attention unchanged. All compute the same attention, so choosing between them never changes
what the model means. Triton is imported only on the kernel path, so the CPU path works without it.
`tree_attention(model, choice)` switches a model to the backend for a block of code.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import prefill_attention
from .config import ATTENTION_CHOICES

NAME = "lookahead_tree"

# Take the kernel path for CPU tensors too. Only meaningful while Triton interprets the kernel
# (TRITON_INTERPRET=1); tests set it to check the kernel path against SDPA without a GPU.
FORCE_KERNEL = False

# Run a CPU prompt's causal prefill on `prefill_attention`'s compiled kernel where it applies (tests switch it off to
# compare against SDPA).
PREFILL_KERNEL = True

# Set by `prompt_after_cache()`: the forward under way forwards the rest of a prompt after cached positions.
_PROMPT_AFTER_CACHE = contextvars.ContextVar("lookahead_prompt_after_cache", default=False)

# Attention features the kernel does not implement; a layer asking for one always runs SDPA.
_KERNEL_UNSUPPORTED_KWARGS = ("softcap", "position_bias", "s_aux")


@contextlib.contextmanager
def prompt_after_cache() -> Iterator[None]:
    """Within the block, a forward of several rows after cached positions is the rest of a prompt: where its mask is
    the causal one, `prefill_attention`'s kernel computes it (as it computes a whole prompt)."""
    token = _PROMPT_AFTER_CACHE.set(True)
    try:
        yield
    finally:
        _PROMPT_AFTER_CACHE.reset(token)


def register() -> str:
    """Register `lookahead_tree` as an attention function and, reusing sdpa's, as a mask function (idempotent).

    Returns:
        The name to give as `attn_implementation` (e.g. `model.set_attn_implementation(register())`).
    """
    AttentionInterface.register(NAME, tree_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


@contextlib.contextmanager
def tree_attention(model, choice: str = "auto") -> Iterator[bool]:
    """Within the block, `model` attends with the `lookahead_tree` backend; yields whether it does.

    choice: "auto" switches a model that uses SDPA (the transformers default); "sdpa" leaves the model as it is;
    "triton" switches any model and raises `ValueError` without CUDA (unless Triton's interpreter is on,
    `TRITON_INTERPRET=1`). The model's own implementation is restored on exit.
    """
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {choice!r}")
    if choice == "triton" and not (_on_cuda(model) or os.environ.get("TRITON_INTERPRET") == "1"):
        raise ValueError("attention='triton' needs a CUDA device (the model is on "
                         f"{next(model.parameters()).device}); use attention='auto' or 'sdpa'")
    own = getattr(model.config, "_attn_implementation", None)
    switch = choice == "triton" or (choice == "auto" and own == "sdpa")
    if not switch or own == NAME:
        yield own == NAME
        return
    model.set_attn_implementation(register())
    try:
        yield True
    finally:
        model.set_attn_implementation(own)


def _on_cuda(model) -> bool:
    """Whether the model's first parameter is on a CUDA device."""
    return next(model.parameters()).is_cuda


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
    if tree_mask is None and _prefill_eligible(module, query, key, attention_mask, dropout, kwargs):
        size = query.shape[-1]
        return prefill_attention.causal_attention(query, key, value, size ** -0.5 if scaling is None else scaling), None
    if tree_mask is None and _grouped_cpu_eligible(module, query, attention_mask, kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None  # [B, T, H, D]
    if tree_mask is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    from lookahead.kernels import tree_attention

    out = tree_attention(query.contiguous(), key.contiguous(), value.contiguous(), tree_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None  # [B, T, H, D]


def _grouped_cpu_eligible(module, query: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether SDPA with `enable_gqa` computes this call exactly as transformers' SDPA path would: a CPU call of a
    grouped-query layer with a 4D mask, or of one query row without a mask (a plain decoding step: transformers
    then passes `enable_gqa` itself, and `is_causal` means nothing for one row), and none of the extras that path
    handles (position bias, paged cache, softcap, attention weights)."""
    if query.is_cuda:
        return False
    if attention_mask is None:
        if query.shape[2] != 1:
            return False
    elif attention_mask.dim() != 4:
        return False
    if getattr(module, "num_key_value_groups", 1) <= 1:
        return False
    return not _asks_extras(kwargs)


def _prefill_eligible(module, query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float,
                      kwargs: dict) -> bool:
    """Whether `prefill_attention` computes this call: a causal prefill it computes, none of the extras SDPA
    handles. A whole prompt comes without a mask (transformers' SDPA path takes it as causal: more than one row, a
    causal layer); the rest of a prompt after cached positions (a reused prompt cache, inside `prompt_after_cache`)
    with a mask, which must be the causal one: every row sees every cached position, itself and the rows before
    it."""
    if query.shape[2] < 2 or (attention_mask is not None and not _PROMPT_AFTER_CACHE.get()):
        return False  # one-row and verification steps: decided at once
    if not PREFILL_KERNEL or not getattr(module, "is_causal", True) or _asks_extras(kwargs):
        return False
    cached = key.shape[2] - query.shape[2]
    if attention_mask is not None and not (cached > 0 and _causal_after_cache(attention_mask, query.shape[2], cached)):
        return False
    return prefill_attention.eligible(query, key, None, dropout, kwargs, cached if attention_mask is not None else 0)


def _causal_after_cache(mask: torch.Tensor, rows: int, cached: int) -> bool:
    """Whether the `[1, 1, rows, cached + rows]` mask `mask` lets row i see the `cached` first keys and rows 0 … i
    of the new ones, and nothing else."""
    if mask.dim() != 4 or tuple(mask.shape) != (1, 1, rows, cached + rows):
        return False
    block = _TREE_BLOCKS.get(mask, cached)  # None unless every row sees every cached key (checked once a mask)
    return block is not None and torch.equal(block, torch.ones(rows, rows, dtype=torch.bool).tril())


def _asks_extras(kwargs: dict) -> bool:
    """Whether a call asks for something transformers' SDPA path handles beyond plain attention (a position bias,
    a paged cache, softcapping, sinks, attention weights)."""
    extras = ("position_bias", "cache") + _KERNEL_UNSUPPORTED_KWARGS
    return any(kwargs.get(name) is not None for name in extras) or bool(kwargs.get("output_attentions"))


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
