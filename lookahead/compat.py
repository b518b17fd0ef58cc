"""The transformers releases lookahead runs on, checked where a generation or a model load starts.

lookahead drives transformers' cache, masks and decoder layers from outside (`cache.py`, `lean_layers.py`,
`hf.py`), so it depends on their exact interfaces. transformers 5.24 renamed `past_key_values` to `cache` in
every model's forward and output and changed its cache layers: run on it, most generations fail and some could
differ from plain `generate`. So an unsupported release is refused with one clear error instead.
"""

from __future__ import annotations

from packaging.version import Version

SUPPORTED = (Version("5.0"), Version("5.24"))  # [oldest, first unsupported), as pyproject.toml pins it


class UnsupportedTransformers(ValueError):
    """The installed transformers release is outside `SUPPORTED`; the message names it and the fix."""


def installed_version() -> str:
    """The version of the transformers package that is imported."""
    import transformers  # the module as imported now (importing it swaps in a lazy module object)

    return transformers.__version__


def check_transformers(version: str | None = None) -> None:
    """Raise `UnsupportedTransformers` unless `version` (None: `installed_version()`) is in `SUPPORTED`;
    development builds count as their release."""
    found = Version(version or installed_version())
    oldest, first_unsupported = SUPPORTED
    if not oldest <= Version(found.base_version) < first_unsupported:
        raise UnsupportedTransformers(
            f"lookahead supports transformers >={oldest},<{first_unsupported}, but {found} is installed: "
            f"pip install 'transformers>={oldest},<{first_unsupported}'")
