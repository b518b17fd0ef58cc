"""benchmarks/bench_editing.py: the editing session's requests, runs and table."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_editing  # noqa: E402  (the benchmarks folder is not a package)
from tiny_models import word_tokenizer  # noqa: E402


def test_session_texts_accept_edit_mid_file_and_press_enter():
    file = "a\nb\nc\nd\n"
    texts = bench_editing.session_texts(file, "e f")
    assert texts == [file, file + "e f", "a\nb\n# reviewed\nc\nd\ne f", "a\nb\n# reviewed\nc\nd\ne f\n"]


def test_sessions_run_every_method_identically_and_reuse_the_prompt(tiny_model):
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    files = [" ".join(f"w{5 + i % 9}" for i in range(30)) + "\n", " ".join(f"w{20 + i % 7}" for i in range(25))]
    runs = bench_editing.run_sessions(model, word_tokenizer(), files, max_new_tokens=6, repeats=1)
    assert len(runs) == len(files) * len(bench_editing.REQUESTS) * len(bench_editing.METHODS)
    assert all(run["identical"] for run in runs if run["method"] != "hf_greedy")
    cached = {(r["file"], r["request"]): r["cached_tokens"] for r in runs if r["method"] == "lookahead_prompt_cache"}
    for index in range(len(files)):
        assert cached[index, "first send"] == 0
        enter = next(r for r in runs if r["file"] == index and r["request"] == "Enter pressed")
        assert cached[index, "Enter pressed"] == enter["prompt_tokens"] - 1  # the same tokens re-sent
    summary = bench_editing.summarize(runs)
    assert summary["Enter pressed"]["lookahead"]["compared"] == 2 == summary["Enter pressed"]["lookahead"]["identical"]
    table = bench_editing.format_table({"summary": summary, "command": "python bench_editing.py",
                                        "machine": {"cpu": "test", "cpu_flags": ["avx2"], "threads": 1},
                                        "settings": {"files": 2, "max_new_tokens": 6, "repeats": 1}})
    assert "| Enter pressed |" in table and "6/6" in table  # 2 files x 3 methods against HF greedy
