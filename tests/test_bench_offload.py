"""The offload benchmark's loop and summary on a tiny model split over CPU and disk (no default model)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_offload  # noqa: E402  (the benchmarks folder is not a package)
from prompts import Prompt  # noqa: E402
from tiny_models import build_tiny_model, word_tokenizer  # noqa: E402

import lookahead  # noqa: E402
from lookahead.models import load_model  # noqa: E402


def test_offloaded_runs_are_compared_and_summarized(tmp_path):
    build_tiny_model("llama", dtype=torch.float32, layers=2).save_pretrained(tmp_path / "m")
    word_tokenizer(64).save_pretrained(tmp_path / "m")
    model, tokenizer = load_model(tmp_path / "m", device_map={"model": "cpu", "lm_head": "disk"},
                                  offload_folder=tmp_path / "off")
    prompts = [Prompt("a", "code", "w5 w6 w7 w8 w5 w6 w7", False), Prompt("b", "rag", "w9 w3 w9 w3 w9", False)]
    runs = bench_offload.run_prompts(model, tokenizer, prompts, max_new_tokens=12, repeats=2, lookahead=lookahead)
    assert len(runs) == 4 and all(run["identical"] for run in runs)
    summary = bench_offload.summarize(runs)
    assert list(summary) == ["code", "rag", "all"] and summary["all"]["runs"] == 4
    step = bench_offload.step_ratio(model, prefix=16, repeats=2)
    assert step["ratio_16"] > 0
    table = bench_offload.format_table({"cpu_flags": ["avx2"], "machine": {"cpu": "x", "threads": 1},
                                        "disk_layers": 1, "step_cost": step, "command": "c", "summary": summary})
    assert table.count("\n| ") == 4  # header + 3 rows
