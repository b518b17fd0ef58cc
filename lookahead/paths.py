"""Where lookahead keeps its on-disk caches (converted models, cost curves)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "LOOKAHEAD_CACHE"


def cache_dir() -> Path:
    """Return the folder for lookahead's caches (`$LOOKAHEAD_CACHE`, else `~/.cache/lookahead`), created."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lookahead")
    root.mkdir(parents=True, exist_ok=True)
    return root
