"""The `lookahead` command's process: torch and transformers import with the garbage collector paused, and the
objects they create are kept out of every later collection.

Importing torch and transformers creates a few million objects that live as long as the process; CPython's cyclic
collector runs over them again and again while they import and later, each time the model's load or the first
generation allocates (~1300 collections in one `lookahead generate` call). Measured on the 2-core AVX2 machine
(session 44), a 64-token call with everything cached spent ~2.2 s in collections: ~1.4 s during the imports, ~0.4 s
during the model's load and ~0.4 s during its one generation. Here the collector is paused while the command's modules
and the parts of transformers every command's model needs import, then their objects are frozen (`gc.freeze`: moved
to a generation collections never scan) and the collector is back for everything made after — the model, the
server's requests — so the command runs as before with ~0.15 s of collections in that call (median of 8 alternated
calls: 14.3 → 12.7 s). `import lookahead` itself, before this runs, imports numba but neither torch nor transformers
(~0.07 s of collections). At exit the objects are unfrozen, so the interpreter's final collection still sees them
(extension modules such as triton's report leaks otherwise). Library users' processes are left alone: this runs only
as the command's entry point.
"""

from __future__ import annotations

import atexit
import gc


def main() -> None:
    """Run the `lookahead` command line (`lookahead.cli.main.main`) with the imports' objects frozen."""
    gc.disable()
    try:
        import transformers.generation.utils  # noqa: F401  (what every command's model needs, imported here)
        import transformers.modeling_utils  # noqa: F401

        from lookahead.cli.main import main as command
    finally:
        gc.freeze()
        gc.enable()
    atexit.register(gc.unfreeze)
    command()
