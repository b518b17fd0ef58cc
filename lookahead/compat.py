"""The transformers releases lookahead runs on, checked where a generation or a model load starts.

lookahead drives transformers' cache, masks and decoder layers from outside (`cache.py`, `lean_layers.py`,
`hf.py`), so it depends on their exact interfaces, and a release outside the ones it is tested on is refused with
one clear error instead of generations that fail or could differ from plain `generate`.

transformers 5.24 renamed the cache's keyword argument and output field from `past_key_values` to `cache` in every
model's forward, in `generate`'s model kwargs and in its outputs (the old keyword still works for a forward,
deprecated). `CACHE_KWARG` is the name the installed release uses; lookahead passes and reads the cache by it.
"""

from __future__ import annotations

from packaging.version import Version

SUPPORTED = (Version("5.0"), Version("5.25"))  # [oldest, first unsupported), as pyproject.toml pins it
RENAMED_CACHE = Version("5.24")  # the first release naming the cache `cache`


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


def cache_kwarg(version: str | None = None) -> str:
    """The keyword (and output field) a model's cache goes by in transformers `version` (None: the installed one):
    `cache` from 5.24 on, `past_key_values` before."""
    found = Version(Version(version or installed_version()).base_version)
    return "cache" if found >= RENAMED_CACHE else "past_key_values"


CACHE_KWARG = cache_kwarg()


def pop_cache(kwargs: dict):
    """Remove the cache from a forward's keyword arguments `kwargs` and return it (None if absent), whichever of its
    two names the caller used."""
    legacy, current = kwargs.pop("past_key_values", None), kwargs.pop("cache", None)
    return current if current is not None else legacy


def output_cache(output):
    """The cache a model output or `generate` output carries (None if it has none)."""
    return getattr(output, CACHE_KWARG, None)
