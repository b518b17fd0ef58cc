"""lookahead: exact, model-free speculative decoding for Hugging Face transformers.

Greedy output is token-identical to `model.generate(do_sample=False)`; see README.md.
"""

from .config import LookaheadConfig
from .hf import Lookahead, patch, unpatch
from .models import ModelLoadError, load_model
from .stats import DecodeStats

__all__ = ["DecodeStats", "Lookahead", "LookaheadConfig", "ModelLoadError", "load_model", "patch", "unpatch"]
__version__ = "0.1.0"
