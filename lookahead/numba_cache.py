"""numba's on-disk cache goes to lookahead's user cache folder, never beside the installed sources.

With `@numba.njit(cache=True)` numba writes `*.nbi`/`*.nbc` files into the source folder's `__pycache__/`. For a
regular install that is `site-packages/lookahead/__pycache__/`, which `pip uninstall` does not know about and
leaves behind; the leftover `site-packages/lookahead/` then shadows a later editable install as an empty
namespace package. numba fixes a function's cache folder when the function is decorated, so this module must
run before any numba-compiled module of the package is imported: `lookahead/__init__.py` imports it first.

numba has one process-wide setting (`numba.config.CACHE_DIR`): numba functions of other packages decorated
after `import lookahead` cache there too. `$NUMBA_CACHE_DIR`, when set, is left alone.
"""

from __future__ import annotations

import numba

from .paths import cache_root

SUBDIR = "numba"


def use_user_cache_dir() -> None:
    """Point numba's cache at `<lookahead cache>/numba` unless the user chose a folder ($NUMBA_CACHE_DIR)."""
    if not numba.config.CACHE_DIR:
        numba.config.CACHE_DIR = str(cache_root() / SUBDIR)


use_user_cache_dir()
