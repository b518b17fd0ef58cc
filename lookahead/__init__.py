"""lookahead: exact, model-free speculative decoding for Hugging Face transformers.

Greedy output is token-identical to `model.generate(do_sample=False)`; see README.md.
"""

from . import numba_cache  # noqa: F401  (first: numba's cache folder must be set before any kernel is decorated)
from .config import LookaheadConfig
from .hf import Lookahead, patch, unpatch
from .models import ModelLoadError, load_model
from .stats import DecodeStats

__all__ = ["DecodeStats", "Lookahead", "LookaheadConfig", "ModelLoadError", "load_model", "patch", "unpatch"]
__version__ = "0.1.0"
