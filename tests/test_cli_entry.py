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
from lookahead.cli.entry import run
sys.argv = ["lookahead", *{argv!r}]
try:
    run()
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
from lookahead.cli.entry import run
stub = types.ModuleType("lookahead.cli.run")
seen = []
stub.run_generate = lambda *args, **kwargs: seen.extend((gc.isenabled(), gc.get_freeze_count()))
sys.modules["lookahead.cli.run"] = stub
sys.argv = ["lookahead", "generate", "hello", "--max-new-tokens", "2"]
try:
    run()
except SystemExit as exc:
    print(*seen, exc.code)
"""


# The console script `main` with the arguments {argv}, an exit handler, an object whose finalizer reports the
# interpreter's teardown and, when {thread}, a thread that is not a daemon still running when the command ends.
CONSOLE = """
import atexit, sys, threading, time
from lookahead.cli.entry import main

class Torn:
    def __del__(self):
        print("torn down", flush=True)

KEPT = Torn()
atexit.register(lambda: print("exit handler", flush=True))
if {thread}:
    threading.Thread(target=lambda: (time.sleep(1.0), print("thread done", flush=True))).start()
sys.argv = ["lookahead", *{argv!r}]
main()
print("not reached")
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


def _console(argv: list[str], thread: bool = False) -> subprocess.CompletedProcess:
    """The console script run in a fresh interpreter (see CONSOLE), its output piped."""
    code = CONSOLE.format(argv=argv, thread=thread)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("argv, status", [(["--help"], 0), (["no-such-command"], 2)])
def test_the_console_script_ends_with_the_commands_status_its_output_flushed_and_no_teardown(argv, status):
    done = _console(argv)
    assert done.returncode == status
    lines = done.stdout.strip().split("\n")
    assert lines[-1] == "exit handler" and "torn down" not in lines and "not reached" not in lines
    if status == 0:
        assert "Usage: lookahead" in done.stdout and "serve" in done.stdout  # the whole help, flushed from the pipe
    else:
        assert "No such command" in done.stderr


def test_a_thread_still_running_leaves_the_exit_to_the_interpreter():
    """The control of the test above: the interpreter waits for the thread, then tears down as usual."""
    done = _console(["--help"], thread=True)
    assert done.returncode == 0
    assert done.stdout.strip().split("\n")[-3:] == ["thread done", "exit handler", "torn down"]


@pytest.mark.parametrize("code, status, stderr", [(None, 0, ""), (3, 3, ""), ("bad input", 1, "bad input\n")])
def test_end_process_reads_the_status_as_system_exit_does(code, status, stderr):
    done = subprocess.run([sys.executable, "-c", f"from lookahead.cli.entry import end_process; end_process({code!r})"],
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stderr) == (status, stderr)
