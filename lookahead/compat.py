"""The transformers releases lookahead runs on, checked where a generation or a model load starts.

lookahead drives transformers' cache, masks and decoder layers from outside (`cache.py`, `lean_layers.py`,
`hf.py`), so it depends on their exact interfaces. transformers 5.24 renamed `past_key_values` to `cache` in
every model's forward and output and changed its cache layers: run on it, most generations fail and some could
differ from plain `generate`. So an unsupported release is refused with one clear error instead.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

SUPPORTED = (Version("5.0"), Version("5.24"))  # [oldest, first unsupported), as pyproject.toml pins it


class UnsupportedTransformers(ValueError):
    """The installed transformers release is outside `SUPPORTED`; the message names it and the fix."""


def check_transformers(version: str | None = None) -> None:
    """Raise `UnsupportedTransformers` unless `version` (None: the installed `transformers.__version__`) is in
    `SUPPORTED`; development builds count as their release."""
    found = Version(version or transformers.__version__)
    oldest, first_unsupported = SUPPORTED
    if not oldest <= Version(found.base_version) < first_unsupported:
        raise UnsupportedTransformers(
            f"lookahead supports transformers >={oldest},<{first_unsupported}, but {found} is installed: "
            f"pip install 'transformers>={oldest},<{first_unsupported}'")
