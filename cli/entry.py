"""The `lookahead` command's process: it parses its arguments before importing torch and transformers (`--help`
and a usage error answer in well under a second), and a command that goes on to load a model imports them with the
garbage collector paused, their objects then kept out of every later collection (`import_model_stack`).

Importing torch and transformers takes several seconds and creates a few million objects that live as long as the
process; CPython's cyclic collector runs over them again and again while they import and later, each time the
model's load or the first generation allocates (~1300 collections in one `lookahead generate` call). Measured on the
2-core AVX2 machine (session 44), a 64-token call with everything cached spent ~2.2 s in collections: ~1.4 s during
the imports, ~0.4 s during the model's load and ~0.4 s during its one generation. Here the collector is paused while
the parts of transformers every command's model needs import, then their objects are frozen (`gc.freeze`: moved to a
generation collections never scan) and the collector is back for everything made after — the model, the server's
requests — so the command runs as before with ~0.15 s of collections in that call (median of 8 alternated calls:
14.3 → 12.7 s). At exit the objects are unfrozen, so the interpreter's final collection still sees them (extension
modules such as triton's report leaks otherwise). Library users' processes, and commands invoked in-process (click's
test runner), are left alone: the collector is paused only in a process started by `main`. That first call also
starts the kernels' compile in a helper process when this installation has none compiled yet (`kernel_warmup`).

When the command is done, the console script ends its process with `os._exit` once the exit handlers have run and
the standard streams are flushed (`end_process`): the interpreter's own teardown of what torch and transformers
imported (~3700 modules, ~750 000 objects, and the model) took ~3 s after the last line was written. Measured on the
2-core AVX2 machine (session 46), a 64-token `lookahead generate` with everything cached: 14.3 / 14.9 s → 11.7 /
11.3 s (two alternated pairs). Where the interpreter must wait (a thread that is not a daemon still runs) or report
(a standard stream that cannot be flushed), it is left to exit as usual.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading

from lookahead import kernel_warmup

_process = {"command": False, "frozen": False}


def main() -> None:
    """The console script: `run` the command line, then end the process without the interpreter's teardown
    (`end_process`)."""
    try:
        run()
    except SystemExit as stop:
        end_process(stop.code)
        raise


def run() -> None:
    """Run the `lookahead` command line (`lookahead.cli.main.main`) as this process's command; raises SystemExit
    with its exit status, as click does."""
    _process["command"] = True
    from lookahead.cli.main import main as command

    command()


def end_process(code: object) -> None:
    """End the process now with exit status `code` (SystemExit's meaning: None is 0, an int itself, anything else
    printed on stderr and 1): the exit handlers run and the standard streams are flushed, then `os._exit` skips
    the teardown of the interpreter's ~3700 modules and ~750 000 objects. Returns, leaving the exit to the
    interpreter, while a thread that is not a daemon still runs (the interpreter waits for it) or when a standard
    stream cannot be flushed (a closed pipe: the interpreter reports it as usual)."""
    if any(thread.is_alive() and not thread.daemon for thread in threading.enumerate()
           if thread is not threading.main_thread()):
        return
    atexit._run_exitfuncs()  # noqa: SLF001 — what the interpreter's exit runs first; the handlers are then cleared
    try:
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def import_model_stack() -> None:
    """Import torch and the parts of transformers every command's model needs; call it once a command's input is
    checked. In the process `main` started, the first call imports them with the collector paused and then freezes
    every object made so far out of later collections."""
    if not _process["command"] or _process["frozen"]:
        _import_stack()
        return
    kernel_warmup.start()  # on an installation's first run: the kernels compile beside the imports and the load
    gc.disable()
    try:
        _import_stack()
    finally:
        gc.freeze()
        gc.enable()
        _process["frozen"] = True
        atexit.register(gc.unfreeze)


def _import_stack() -> None:
    """Import torch, transformers' model and generation modules."""
    import torch  # noqa: F401
    import transformers.generation.utils  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
