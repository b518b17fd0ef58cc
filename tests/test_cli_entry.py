"""`lookahead.cli.entry`: the command parses its arguments before torch and transformers import; a command that
loads a model imports them with the garbage collector paused and runs with their objects frozen out of it;
`import lookahead` alone imports neither."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Runs the `lookahead` command in a fresh interpreter with the arguments {argv}; prints its exit code and whether
# torch and transformers were imported by then.
RUN = """
import sys
from lookahead.cli.entry import main
sys.argv = ["lookahead", *{argv!r}]
try:
    main()
except SystemExit as exc:
    print(exc.code, "torch" in sys.modules, "transformers" in sys.modules)
"""

# After `import lookahead` (numba; no torch or transformers yet): counts the collections that start while
# `import_model_stack` runs, as the command's process ({command}) or not, then prints that count, whether the
# collector is on and how many objects are frozen.
PROBE = """
import gc
from lookahead.cli import entry
entry._process["command"] = {command}
started = [0]
gc.callbacks.append(lambda phase, info: phase == "start" and started.__setitem__(0, started[0] + 1))
entry.import_model_stack()
print(started[0], gc.isenabled(), gc.get_freeze_count())
"""

# The `generate` command run to its model's load (replaced by a report of the collector's state there).
GENERATE = """
import gc, sys, types
from lookahead.cli.entry import main
stub = types.ModuleType("lookahead.cli.run")
seen = []
stub.run_generate = lambda *args, **kwargs: seen.extend((gc.isenabled(), gc.get_freeze_count()))
sys.modules["lookahead.cli.run"] = stub
sys.argv = ["lookahead", "generate", "hello", "--max-new-tokens", "2"]
try:
    main()
except SystemExit as exc:
    print(*seen, exc.code)
"""


def _python(code: str) -> list[str]:
    """The last line `code` printed on stdout in a fresh interpreter (after any help text), split on whitespace."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return done.stdout.strip().split("\n")[-1].split()


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["--version"], 0), (["generate", "--help"], 0),
                                        (["serve", "--help"], 0), (["generate", "--max-new-tokens", "0", "x"], 2),
                                        (["generate", "--temperature", "0.5", "x"], 2),
                                        (["generate", "--mode", "off", "--datastore", ".", "x"], 2),
                                        (["serve", "--host", "0.0.0.0"], 2), (["serve", "--allow-origin", "x"], 2),
                                        (["train-head", "/no/such/folder/head.safetensors"], 2),
                                        (["no-such-command"], 2)])
def test_help_and_usage_errors_answer_before_torch_and_transformers_import(argv, code):
    assert _python(RUN.format(argv=argv)) == [str(code), "False", "False"]


def test_a_command_that_runs_imports_them():
    """The control of the test above: the probe sees the imports when the command gets past its checks."""
    assert _python(RUN.format(argv=["calibrate", "--model", "/no/such/model"]))[1:] == ["True", "True"]


def test_the_command_imports_them_without_collections_and_freezes_their_objects():
    collections, enabled, frozen = _python(PROBE.format(command=True))
    assert collections == "0" and enabled == "True"
    assert int(frozen) > 100_000  # torch's and transformers' objects


def test_imported_outside_the_command_the_collector_runs_many_times_and_nothing_is_frozen():
    """The negative control, and what a library user's process or click's test runner gets."""
    collections, enabled, frozen = _python(PROBE.format(command=False))
    assert int(collections) > 50 and enabled == "True" and frozen == "0"


def test_generate_loads_its_model_with_the_collector_on_and_the_imports_frozen():
    enabled, frozen, code = _python(GENERATE)
    assert enabled == "True" and int(frozen) > 100_000 and code == "0"


def test_import_lookahead_leaves_torch_and_transformers_for_first_use():
    code = ("import sys, lookahead; print('torch' in sys.modules, 'transformers' in sys.modules); lookahead.Lookahead; "
            "print('transformers' in sys.modules, sorted(set(lookahead.__all__) - set(dir(lookahead))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.split("\n")[:2] == ["False False", "True []"]


def test_the_command_exits_without_leak_reports():
    done = subprocess.run([sys.executable, "-m", "lookahead.cli", "calibrate", "--model", "/no/such/model"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "/no/such/model" in done.stderr
    assert "leak" not in done.stderr
