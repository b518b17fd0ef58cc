"""Triton kernels and their plain-PyTorch references (installed as `lookahead.kernels`)."""

from .tree_attention import tree_attention

__all__ = ["tree_attention"]
