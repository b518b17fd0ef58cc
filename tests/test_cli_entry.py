"""`lookahead.cli.entry`: the command's modules import with the garbage collector paused, the command runs with it
on and their objects frozen; `import lookahead` alone imports neither torch nor transformers."""

from __future__ import annotations

import atexit
import gc
import subprocess
import sys

from lookahead.cli import entry

# After `import lookahead` (numba; no torch or transformers yet): counts the collections that start while `{start}`
# runs until the `lookahead` command itself is called (click's `Command.__call__`), then prints that count, whether
# the collector is on and how many objects are frozen, and stops.
PROBE = """
import gc, sys
import click
import lookahead
started = [0]
gc.callbacks.append(lambda phase, info: phase == "start" and started.__setitem__(0, started[0] + 1))
def report(self, *args, **kwargs):
    print(started[0], gc.isenabled(), gc.get_freeze_count())
    sys.exit(0)
click.Command.__call__ = report
{start}
"""


def _probe(start: str) -> tuple[int, bool, int]:
    """(collections before the command, collector on, frozen objects) in a fresh interpreter started by `start`."""
    done = subprocess.run([sys.executable, "-c", PROBE.format(start=start)], capture_output=True, text=True,
                          timeout=300, check=True)
    collections, enabled, frozen = done.stdout.split()
    return int(collections), enabled == "True", int(frozen)


def test_the_command_imports_without_collections_and_runs_with_them_frozen_out():
    collections, enabled, frozen = _probe("from lookahead.cli.entry import main; main()")
    assert collections == 0 and enabled
    assert frozen > 100_000  # torch's and transformers' objects


def test_imported_as_before_the_collector_runs_many_times():
    """The negative control: the same command module imported with the collector on."""
    collections, enabled, frozen = _probe("from lookahead.cli.main import main; main()")
    assert collections > 50 and enabled and frozen == 0


def test_the_command_runs_with_the_collector_on(monkeypatch):
    seen = []
    monkeypatch.setattr("lookahead.cli.main.main", lambda: seen.append((gc.isenabled(), gc.get_freeze_count())))
    try:
        entry.main()
    finally:
        gc.unfreeze()
        atexit.unregister(gc.unfreeze)
    assert seen and seen[0][0] and seen[0][1] > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_import_lookahead_leaves_torch_and_transformers_for_first_use():
    code = ("import sys, lookahead; print('torch' in sys.modules, 'transformers' in sys.modules); lookahead.Lookahead; "
            "print('transformers' in sys.modules, sorted(set(lookahead.__all__) - set(dir(lookahead))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.split("\n")[:2] == ["False False", "True []"]


def test_the_command_exits_without_leak_reports():
    done = subprocess.run([sys.executable, "-m", "lookahead.cli", "--help"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "generate" in done.stdout
    assert "leak" not in done.stderr
