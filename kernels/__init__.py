"""Triton kernels and their plain-PyTorch references (installed as `lookahead.kernels`)."""
