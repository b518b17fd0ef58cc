"""`kernels/` and `cli/` are installed inside the `lookahead` namespace, not as generic top-level names."""

from __future__ import annotations

import importlib
from pathlib import Path


def test_kernels_and_cli_live_in_the_lookahead_namespace():
    kernels = importlib.import_module("lookahead.kernels")
    cli = importlib.import_module("lookahead.cli")
    assert Path(kernels.__file__).resolve().parent.name == "kernels"
    assert Path(cli.__file__).resolve().parent.name == "cli"
    assert callable(kernels.tree_attention)
    assert callable(importlib.import_module("lookahead.cli.main").main)


def test_only_lookahead_is_a_top_level_name():
    from importlib.metadata import distribution

    top_level = distribution("lookahead-decoding").read_text("top_level.txt").split()
    assert top_level == ["lookahead"]


def test_console_script_is_declared():
    from importlib.metadata import entry_points

    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("lookahead") == "lookahead.cli.main:main"
