"""lookahead: exact, model-free speculative decoding for Hugging Face transformers.

Greedy output is token-identical to `model.generate(do_sample=False)`; see README.md.

`import lookahead` itself imports neither torch nor transformers: `Lookahead`, `patch`, `unpatch`, `load_model` and
`ModelLoadError` import their modules (and so transformers) on first use, so that the `lookahead` command can import
them with the garbage collector paused (`lookahead.cli.entry`).
"""

from importlib import import_module

from . import numba_cache  # noqa: F401  (first: numba's cache folder must be set before any kernel is decorated)
from . import cpu_load  # noqa: F401  (its START sample: how busy the machine is while the caller loads)
from .config import LookaheadConfig
from .stats import DecodeStats

__all__ = ["DecodeStats", "Lookahead", "LookaheadConfig", "ModelLoadError", "load_model", "patch", "unpatch"]
__version__ = "0.1.0"

_LAZY = {"Lookahead": "hf", "patch": "hf", "unpatch": "hf", "load_model": "models", "ModelLoadError": "models"}


def __getattr__(name: str):
    """The public names of `hf` and `models`, imported on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the lazily imported ones included."""
    return sorted(set(globals()) | set(__all__))
