"""The busy-machine benchmark's loop, spinners and summary on a tiny model (no default model, no timing asserted)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_busy  # noqa: E402  (the benchmarks folder is not a package)
from prompts import Prompt  # noqa: E402
from tiny_models import build_tiny_model, word_tokenizer  # noqa: E402

import lookahead  # noqa: E402


def test_every_method_runs_is_compared_and_summarized():
    model, tokenizer = build_tiny_model("llama", dtype=torch.float64, layers=2), word_tokenizer(64)
    prompts = [Prompt("a", "code", "w5 w6 w7 w8 w5 w6 w7", False), Prompt("b", "chat", "w9 w3 w9 w3 w9", False)]
    threads = torch.get_num_threads()
    args = argparse.Namespace(repeats=2, max_new_tokens=12, threads=threads)
    runs = bench_busy.run_prompts(model, tokenizer, prompts, args, lookahead)
    assert torch.get_num_threads() == threads  # the one-thread HF runs give the count back
    assert len(runs) == 4 and all(run["identical"] for run in runs)
    assert all(set(bench_busy.METHODS) <= set(run) for run in runs)
    summary = bench_busy.summarize(runs)
    assert summary["identical"] == "4/4" and summary["hf_greedy"]["speedup_vs_hf_greedy"] == 1.0
    table = bench_busy.format_table({"cpu_flags": ["avx2"], "machine": {"cpu": "x", "cpu_count": 2, "threads": 2},
                                     "busy_processes": 1, "command": "c", "summary": summary})
    assert table.count("\n| ") == 1 + len(bench_busy.METHODS)  # header + one row per method


def test_busy_processes_spin_while_the_block_runs_and_are_killed_after():
    with bench_busy.busy_processes(2) as spinners:
        assert len(spinners) == 2 and all(s.poll() is None for s in spinners)
    assert all(s.poll() is not None for s in spinners)
