"""`lookahead.datastore`: text files into a suffix cache that drafts; outputs stay exactly plain greedy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build_tiny_model

from lookahead import Lookahead
from lookahead.datastore import build_datastore, text_files


class IdsTokenizer:
    """A tokenizer over texts of space-separated token ids (so a file can hold exact model outputs)."""

    def __call__(self, text, add_special_tokens=True, verbose=True):
        return {"input_ids": [int(t) for t in text.split()]}


def _write(path, ids):
    path.write_text(" ".join(map(str, ids)))


def test_text_files_walks_folders_in_order_and_skips_hidden(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    for name in ("b/z.py", "b/a.py", "c.txt", ".git/HEAD", ".hidden"):
        (tmp_path / name).write_text("1 2 3")
    assert text_files([tmp_path]) == [tmp_path / "b/a.py", tmp_path / "b/z.py", tmp_path / "c.txt"]
    assert text_files([tmp_path / "c.txt"]) == [tmp_path / "c.txt"]


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: p, "no files in datastore paths"),
])
def test_missing_or_empty_paths_are_errors(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        build_datastore([make(tmp_path)], IdsTokenizer())


def test_binary_files_are_skipped_and_counted(tmp_path):
    _write(tmp_path / "a.txt", [1, 2, 3, 4])
    (tmp_path / "b.bin").write_bytes(b"\x00\x01")
    (tmp_path / "c.txt").write_bytes(b"caf\xe9")
    cache, report = build_datastore([tmp_path], IdsTokenizer())
    assert (report.files, report.tokens, report.left_out) == (1, 4, 0)
    assert report.skipped == [str(tmp_path / "b.bin"), str(tmp_path / "c.txt")]
    assert report.summary() == "datastore: 1 files, 4 tokens (2 skipped: not UTF-8 text)"
    with pytest.raises(ValueError, match="no UTF-8 text files"):
        build_datastore([tmp_path / "b.bin"], IdsTokenizer())


def test_token_bound_cuts_and_counts_the_files_left_out(tmp_path):
    for i in range(4):
        _write(tmp_path / f"{i}.txt", range(10 * i, 10 * i + 10))
    cache, report = build_datastore([tmp_path], IdsTokenizer(), max_tokens=25)
    assert (report.files, report.tokens, report.left_out, len(cache)) == (3, 25, 1, 25)
    assert "1 left out: token bound reached" in report.summary()
    with pytest.raises(ValueError, match="max_tokens"):
        build_datastore([tmp_path], IdsTokenizer(), max_tokens=0)


def test_each_file_drafts_its_own_continuation(tmp_path):
    _write(tmp_path / "a.txt", [5, 6, 7, 8, 9])
    _write(tmp_path / "b.txt", [1, 2, 3])
    cache, _ = build_datastore([tmp_path], IdsTokenizer())
    assert [p.tolist() for p in cache.propose(np.array([0, 6, 7]), 3, 4)] == [[8, 9]]
    assert cache.propose(np.array([8, 9]), 3, 4) == []  # no draft runs from one file into the next


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_datastore_of_the_output_keeps_greedy_identical_and_takes_fewer_steps(tmp_path, arch):
    model = build_tiny_model(arch, dtype=torch.float32, seed=3)
    prompt = torch.tensor([[11, 42, 7, 59, 3, 25, 17]])
    plain = model.generate(prompt, max_new_tokens=40, do_sample=False)
    _write(tmp_path / "out.txt", plain[0].tolist())
    cache, _ = build_datastore([tmp_path], IdsTokenizer())
    without, with_store = Lookahead(), Lookahead(shared_drafter=cache)
    assert torch.equal(model.generate(prompt, max_new_tokens=40, do_sample=False, custom_generate=without), plain)
    assert torch.equal(model.generate(prompt, max_new_tokens=40, do_sample=False, custom_generate=with_store),
                       plain)
    assert with_store.last_stats.steps < without.last_stats.steps
