"""benchmarks/bench_prefill.py: long prompts against plain HF greedy, its runs, table and arguments."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_prefill  # noqa: E402  (the benchmarks folder is not a package)


def test_a_prompt_is_timed_both_ways_and_checked_against_greedy(tiny_model):
    model = tiny_model("llama", dtype=torch.float32, seed=0)
    ids = torch.randint(0, 64, (1, 90), generator=torch.Generator().manual_seed(0))
    row = bench_prefill.measure(model, ids, max_new_tokens=5, repeats=2)
    assert row["prompt_tokens"] == 90 and row["identical"] is True
    assert all(len(times) == 2 for times in row["runs"].values())  # the warm-up left out
    assert row["prefill_s"] <= row["lookahead_s"] and row["speedup"] == row["hf_s"] / row["lookahead_s"]
    assert row["new_tokens"] == 5
    assert row["decode_tokens_per_s"] == pytest.approx(4 / (row["lookahead_s"] - row["prefill_s"]))
    table = bench_prefill.table([row, {**row, "prompt_tokens": 180, "identical": False, "decode_tokens_per_s": None}])
    assert "| 90 |" in table and table.rstrip().endswith("| — | %.2fx | NO |" % row["speedup"])
    assert f"| {row['decode_tokens_per_s']:.1f} |" in table.splitlines()[2]


def test_its_settings_are_json_values(tmp_path):
    args = bench_prefill.parse_args(["--lengths", "100", "200", "--out", str(tmp_path / "x.json")])
    assert json.loads(json.dumps(bench_prefill.settings(args)))["out"] == str(tmp_path / "x.json")


@pytest.mark.parametrize("argv, message", [(["--repeats", "0"], "--repeats must be at least 1"),
                                           (["--lengths", "100", "0"], "--lengths must be at least 1")])
def test_counts_below_one_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_prefill.parse_args(argv)
    assert message in capsys.readouterr().err
