"""Unsupported transformers releases are refused with one clear error, at generate and at model load; the cache's
keyword follows the installed release."""

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
from lookahead.compat import CACHE_KWARG, SUPPORTED, UnsupportedTransformers, cache_kwarg, check_transformers, pop_cache
from lookahead.models import ModelLoadError, load_model

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["5.0.0", "5.23.0", "5.23.1", "5.23.0.dev0", "5.24.0", "5.24.1"])
def test_supported_releases_pass(version):
    check_transformers(version)


@pytest.mark.parametrize("version", ["4.57.1", "5.25.0", "5.25.0.dev0", "6.0.0"])
def test_unsupported_releases_are_refused_naming_the_fix(version):
    fix = "pip install 'transformers>=5.0,<5.25'"
    with pytest.raises(UnsupportedTransformers, match=rf"but {version} is installed: {fix}"):
        check_transformers(version)


def test_the_installed_release_is_supported():
    import transformers

    assert compat.installed_version() == transformers.__version__
    check_transformers()


@pytest.mark.parametrize(("version", "name"), [("5.0.0", "past_key_values"), ("5.23.1", "past_key_values"),
                                                ("5.24.0.dev0", "cache"), ("5.24.0", "cache")])
def test_the_cache_keyword_follows_the_release(version, name):
    assert cache_kwarg(version) == name


def test_the_installed_release_takes_its_cache_by_that_keyword():
    """A model forward of the installed release returns its cache in the field `CACHE_KWARG` names, and takes it
    back by that keyword (without a deprecation warning)."""
    import warnings

    model = build_tiny_model("llama", dtype=torch.float32, seed=0)
    prompt = repetitive_prompt(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = model(prompt[:, :4], use_cache=True)
        cache = compat.output_cache(first)
        assert cache is not None and cache.get_seq_length() == 4
        model(prompt[:, 4:6], use_cache=True, **{CACHE_KWARG: cache})
    assert cache.get_seq_length() == 6


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_pop_cache_takes_either_name(name):
    kwargs = {name: "the cache", "use_cache": True}
    assert pop_cache(kwargs) == "the cache" and kwargs == {"use_cache": True}
    assert pop_cache({}) is None


def test_pyproject_pins_the_supported_range():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d for d in deps if d.startswith("transformers"))
    assert pin == f"transformers>={SUPPORTED[0]},<{SUPPORTED[1]}"


def test_generate_refuses_before_decoding(monkeypatch):
    model = build_tiny_model("llama", dtype=torch.float32, seed=0)
    prompt = repetitive_prompt(0)
    monkeypatch.setattr(compat, "installed_version", lambda: "5.25.0")
    decoder = Lookahead()
    with pytest.raises(UnsupportedTransformers, match="5.25.0 is installed"):
        model.generate(prompt, max_new_tokens=4, do_sample=False, custom_generate=decoder)
    assert decoder.last_stats is None


def test_load_model_and_cli_refuse_with_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(compat, "installed_version", lambda: "5.25.0")
    with pytest.raises(ModelLoadError, match="5.25.0 is installed"):
        load_model(tmp_path)
    result = CliRunner().invoke(main, ["generate", "hi", "--model", str(tmp_path)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith("Error: lookahead supports transformers >=5.0,<5.25")
