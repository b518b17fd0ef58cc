"""Where lookahead keeps its on-disk caches (converted models, cost curves)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "LOOKAHEAD_CACHE"


def cache_root() -> Path:
    """Return the folder for lookahead's caches (`$LOOKAHEAD_CACHE`, else `~/.cache/lookahead`), not created."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lookahead")


def cache_dir() -> Path:
    """Return `cache_root()`, created."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return root
