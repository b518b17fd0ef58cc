"""numba's on-disk cache goes to lookahead's user cache folder, never beside the installed sources.

With `@numba.njit(cache=True)` numba writes `*.nbi`/`*.nbc` files into the source folder's `__pycache__/`. For a
regular install that is `site-packages/lookahead/__pycache__/`, which `pip uninstall` does not know about and
leaves behind; the leftover `site-packages/lookahead/` then shadows a later editable install as an empty
namespace package. numba fixes a function's cache folder when the function is decorated, so this module must
run before any numba-compiled module of the package is imported: `lookahead/__init__.py` imports it first.

numba has one process-wide setting (`numba.config.CACHE_DIR`): numba functions of other packages decorated
after `import lookahead` cache there too. `$NUMBA_CACHE_DIR`, when set, is left alone.

numba checks a cached function against its own source file only: a compiled caller keeps the code of a function
it calls from another module (`recycle.py` calls `gumbel.py`, `prompt_lookup.py` calls `suffix_index.py`) even
after that module changed, e.g. by an upgrade. So the cache folder is named by a digest of the package's sources:
changed sources compile afresh into a folder of their own.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numba

from .paths import cache_root

SUBDIR = "numba"


def source_digest(folder: Path) -> str:
    """16 hex digits of SHA-256 over the names and contents of the `.py` files directly in `folder`."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def use_user_cache_dir() -> bool:
    """Point numba's cache at `<lookahead cache>/numba/<source digest>` unless the user chose a folder
    ($NUMBA_CACHE_DIR); whether that folder held no compiled code yet (False for a folder the user chose)."""
    if numba.config.CACHE_DIR:
        return False
    folder = cache_root() / SUBDIR / source_digest(Path(__file__).parent)
    numba.config.CACHE_DIR = str(folder)
    return not any(folder.glob("*/*.nbc"))


_own_folder = not numba.config.CACHE_DIR  # lookahead picks the folder (no $NUMBA_CACHE_DIR)
_fresh = use_user_cache_dir()
HELPER_DONE = "helper-done"  # in the cache folder: a compile helper (`kernel_warmup`) ran to its end there


def helper_wanted() -> bool:
    """Whether a compile helper (`kernel_warmup`) should compile this installation's kernels: the cache folder is
    lookahead's own (never a $NUMBA_CACHE_DIR the user chose) and no helper has run to its end there yet — so a
    folder left partly compiled (a first run stopped midway, tests run against the installation) gets the helper
    too, instead of a silent compile inside the first generation."""
    return _own_folder and not (Path(numba.config.CACHE_DIR) / HELPER_DONE).exists()


def mark_helper_done() -> None:
    """Record in the cache folder that a compile helper ran to its end there (see `helper_wanted`)."""
    folder = Path(numba.config.CACHE_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / HELPER_DONE).touch()


def is_fresh() -> bool:
    """Whether this installation's kernels were not compiled yet when this process started (and no notice of their
    compile has been given since: `compiling_notice`)."""
    return _fresh


def restore_compiling_notice() -> None:
    """Give the compile notice again (`compiling_notice`): a helper meant to compile the kernels did not."""
    global _fresh
    _fresh = True


def compiling_notice() -> str | None:
    """Once per process, when this installation's kernels have not been compiled yet (a new install or upgrade, or
    a cleared cache): the one-line notice that the first generation compiles them and how long that takes, so a
    silent minute is not mistaken for a hang; None otherwise."""
    global _fresh
    fresh, _fresh = _fresh, False
    if not fresh:
        return None
    return ("lookahead: compiling its CPU kernels for this installation, once (1–2 minutes on a 2-core CPU; "
            f"cached in {numba.config.CACHE_DIR})")
