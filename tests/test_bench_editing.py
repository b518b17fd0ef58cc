"""benchmarks/bench_editing.py: the editing session's requests, runs and table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_editing  # noqa: E402  (the benchmarks folder is not a package)
from tiny_models import word_tokenizer  # noqa: E402


def test_session_texts_accept_edit_mid_file_and_press_enter():
    file = "a\nb\nc\nd\n"
    texts = bench_editing.session_texts(file, "e f")
    assert texts == [file, file + "e f", "a\nb\n# reviewed\nc\nd\ne f", "a\nb\n# reviewed\nc\nd\ne f\n"]


def test_sessions_run_every_method_identically_and_reuse_the_prompt(tiny_model):
    model, tokenizer = tiny_model("llama", dtype=torch.float64, seed=0), word_tokenizer()
    files = [" ".join(f"w{5 + i % 9}" for i in range(30)) + "\n", " ".join(f"w{20 + i % 7}" for i in range(25))]
    sessions = [bench_editing.file_session(model, tokenizer, file) for file in files]
    sessions.append(bench_editing.chat_session(model, tokenizer, "w7 w8 w9", "w10 w11", 6))
    runs = bench_editing.run_sessions(model, sessions, max_new_tokens=6, repeats=1)
    assert len(runs) == (2 * len(bench_editing.EDITS) + len(bench_editing.TURNS)) * len(bench_editing.METHODS)
    assert all(run["identical"] for run in runs if run["method"] != "hf_greedy")
    cached = {(r["session"], r["request"]): r for r in runs if r["method"] == "lookahead_prompt_cache"}
    for index in range(len(files)):
        assert cached[index, "first send"]["cached_tokens"] == 0
        enter = cached[index, "Enter pressed"]
        assert enter["cached_tokens"] == enter["prompt_tokens"] - 1  # the same tokens re-sent
    first, second = cached[2, "chat: first turn"], cached[2, "chat: second turn"]
    # the word tokenizer's template ends a prompt with "w3", which the next turn's text does not repeat
    assert first["cached_tokens"] == 0 and second["cached_tokens"] == first["prompt_tokens"] - 1
    summary = bench_editing.summarize(runs)
    assert summary["Enter pressed"]["lookahead"]["compared"] == 2 == summary["Enter pressed"]["lookahead"]["identical"]
    table = bench_editing.format_table({"summary": summary, "command": "python bench_editing.py",
                                        "machine": {"cpu": "test", "cpu_flags": ["avx2"], "threads": 1},
                                        "settings": {"files": 2, "chats": 1, "max_new_tokens": 6, "repeats": 1}})
    assert "| Enter pressed |" in table and "6/6" in table  # 2 files x 3 methods against HF greedy
    assert "| chat: second turn |" in table and "3/3" in table


def test_second_turns_are_mt_benchs():
    from prompts import load_prompts, second_turns

    chats = load_prompts(["chat"], 2)
    turns = second_turns(chats)
    assert len(turns) == 2 and all(turns) and turns[0] != chats[0].text
    with pytest.raises(ValueError, match="no second turn"):
        second_turns(load_prompts(["code"], 1))
