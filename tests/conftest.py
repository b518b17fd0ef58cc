"""Shared fixtures: tiny random causal LMs built in-process from a config (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_models import build_tiny_model

# Triton has no CPU backend: kernels run under its interpreter, which must be switched on before triton is
# first imported anywhere in the session (transformers imports it early).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model():
    """The `build_tiny_model(family=..., dtype=..., seed=..., vocab=..., layers=..., **overrides)` factory."""
    return build_tiny_model
