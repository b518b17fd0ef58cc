"""Unsupported transformers releases are refused with one clear error, at generate and at model load."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny_models import build_tiny_model, repetitive_prompt

from lookahead import Lookahead
from lookahead.cli.main import main
from lookahead import compat
from lookahead.compat import SUPPORTED, UnsupportedTransformers, check_transformers
from lookahead.models import ModelLoadError, load_model

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["5.0.0", "5.23.0", "5.23.1", "5.23.0.dev0"])
def test_supported_releases_pass(version):
    check_transformers(version)


@pytest.mark.parametrize("version", ["4.57.1", "5.24.0", "5.24.0.dev0", "6.0.0"])
def test_unsupported_releases_are_refused_naming_the_fix(version):
    fix = "pip install 'transformers>=5.0,<5.24'"
    with pytest.raises(UnsupportedTransformers, match=rf"but {version} is installed: {fix}"):
        check_transformers(version)


def test_the_installed_release_is_supported():
    import transformers

    assert compat.installed_version() == transformers.__version__
    check_transformers()


def test_pyproject_pins_the_supported_range():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d for d in deps if d.startswith("transformers"))
    assert pin == f"transformers>={SUPPORTED[0]},<{SUPPORTED[1]}"


def test_generate_refuses_before_decoding(monkeypatch):
    model = build_tiny_model("llama", dtype=torch.float32, seed=0)
    prompt = repetitive_prompt(0)
    monkeypatch.setattr(compat, "installed_version", lambda: "5.24.0")
    decoder = Lookahead()
    with pytest.raises(UnsupportedTransformers, match="5.24.0 is installed"):
        model.generate(prompt, max_new_tokens=4, do_sample=False, custom_generate=decoder)
    assert decoder.last_stats is None


def test_load_model_and_cli_refuse_with_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(compat, "installed_version", lambda: "5.24.0")
    with pytest.raises(ModelLoadError, match="5.24.0 is installed"):
        load_model(tmp_path)
    result = CliRunner().invoke(main, ["generate", "hi", "--model", str(tmp_path)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith("Error: lookahead supports transformers >=5.0,<5.24")
