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
    assert scripts.get("lookahead") == "lookahead.cli.entry:main"


# -- the repository stands alone ------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def test_prompts_are_vendored_inside_the_repository():
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        prompts = importlib.import_module("prompts")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert prompts.DEFAULT_PROMPTS_DIR.resolve().is_relative_to(REPO)
    assert len(prompts.load_prompts(prompts.DEFAULT_CATEGORIES, 4)) == 4 * len(prompts.DEFAULT_CATEGORIES)
    notes = (prompts.DEFAULT_PROMPTS_DIR / "README.md").read_text()
    assert "MIT" in notes and "Apache-2.0" in notes
    assert (prompts.DEFAULT_PROMPTS_DIR / "LICENSE.humaneval").is_file()
    assert (prompts.DEFAULT_PROMPTS_DIR / "LICENSE.spec-bench").is_file()


def test_no_source_file_reads_outside_the_repository():
    """The prompts once lived in `../shared/prompts`; a fresh clone has no such folder."""
    outside = ("shared/prompts", '/ "shared" /')
    sources = [p for folder in ("lookahead", "cli", "kernels", "benchmarks", "tests")
               for p in (REPO / folder).rglob("*.py") if p != Path(__file__).resolve()]
    offenders = [str(p.relative_to(REPO)) for p in sources if any(s in p.read_text() for s in outside)]
    assert offenders == []


# -- numba's cache stays out of the installed package ---------------------------------------------------------

_RUN_DRAFTERS = """
import numpy as np
import lookahead
from lookahead.ngram_pool import NGramPool
from lookahead.prompt_lookup import PromptLookup
from lookahead.suffix_cache import SuffixCache

text = np.array([1, 2, 3, 4, 1, 2, 3], dtype=np.int64)
lookup = PromptLookup()
lookup.extend(text)
lookup.propose(4, 4)
pool = NGramPool(3, 16)
pool.add_text(text)
pool.lookup(1, 4)
cache = SuffixCache()
cache.add(text)
cache.propose(text[:3], 4, 4)
print(lookahead.__file__)
"""


def test_numba_caches_go_to_the_user_cache_folder(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"} | {"LOOKAHEAD_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", _RUN_DRAFTERS], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    package = Path(run.stdout.strip()).parent
    in_package = [p for p in package.rglob("*") if p.suffix in (".nbi", ".nbc")]
    assert in_package == [], f"numba cache files inside the package: {in_package[:3]}"
    cached = {p.suffix for p in (tmp_path / "numba").rglob("*")}
    assert {".nbi", ".nbc"} <= cached


def test_numba_cache_dir_set_by_the_user_is_kept(tmp_path):
    import os
    import subprocess
    import sys

    chosen = tmp_path / "mine"
    env = os.environ | {"LOOKAHEAD_CACHE": str(tmp_path / "lookahead"), "NUMBA_CACHE_DIR": str(chosen)}
    code = "import lookahead, numba; print(numba.config.CACHE_DIR)"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(chosen)


def test_numba_cache_folder_follows_the_package_sources(tmp_path):
    import os
    import subprocess
    import sys

    from lookahead.numba_cache import source_digest

    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "a.py").write_text("x = 1\n")
    (folder / "b.py").write_text("y = 2\n")
    first = source_digest(folder)
    assert source_digest(folder) == first
    (folder / "b.py").write_text("y = 3\n")  # a callee changed, its caller did not: a new folder
    assert source_digest(folder) != first
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"} | {"LOOKAHEAD_CACHE": str(tmp_path)}
    code = "import lookahead, numba; print(lookahead.__file__); print(numba.config.CACHE_DIR)"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    package, cache = run.stdout.split()
    assert Path(cache) == tmp_path / "numba" / source_digest(Path(package).parent)


def test_a_fresh_kernel_cache_is_found_and_a_chosen_one_is_not(tmp_path, monkeypatch):
    import numba

    from lookahead import numba_cache

    monkeypatch.setattr(numba_cache, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(numba.config, "CACHE_DIR", "")
    assert numba_cache.use_user_cache_dir()  # nothing compiled in this installation's folder yet
    folder = Path(numba.config.CACHE_DIR)
    assert folder.parent == tmp_path / numba_cache.SUBDIR
    (folder / "lookahead_0").mkdir(parents=True)
    (folder / "lookahead_0" / "recycle._top_k-1.py311.1.nbc").write_bytes(b"")
    monkeypatch.setattr(numba.config, "CACHE_DIR", "")
    assert not numba_cache.use_user_cache_dir()  # compiled before
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "mine"))
    assert not numba_cache.use_user_cache_dir()  # the user's own folder: nothing is known of it


def test_the_first_generation_says_once_that_it_compiles_the_kernels(monkeypatch, capsys):
    from tiny_models import build_tiny_model, repetitive_prompt

    from lookahead import Lookahead, hf, numba_cache

    model = build_tiny_model()
    monkeypatch.setattr(numba_cache, "_fresh", True)
    for _ in range(2):
        model.generate(repetitive_prompt(0), max_new_tokens=3, do_sample=False, custom_generate=Lookahead())
    said = capsys.readouterr().err
    assert said.count("lookahead: compiling its CPU kernels for this installation, once") == 1
    monkeypatch.setattr(numba_cache, "_fresh", True)
    monkeypatch.setattr(hf, "follower_process", lambda: True)  # a torch.distributed rank other than 0
    model.generate(repetitive_prompt(0), max_new_tokens=3, do_sample=False, custom_generate=Lookahead())
    assert numba_cache.compiling_notice() is None  # the notice is taken once per process, said or not
    assert "compiling" not in capsys.readouterr().err
