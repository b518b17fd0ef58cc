"""Smoke test of benchmarks/bench_step.py on a tiny model: every variant and row count is timed, the prepacked
variants compute each row count on the kernel `--default-rows` / `--streamed-rows` name (lean-onednn without the
streamed kernel), and the table says so (no timing is asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tiny_models import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_step  # noqa: E402  (the benchmarks folder is not a package)

from lookahead import streamed_gemm  # noqa: E402


def test_step_benchmark_runs_every_variant_with_the_given_row_kernels(tmp_path, capsys, monkeypatch):
    from lookahead import row_kernels
    from lookahead.row_kernels import RowKernels

    model = build_tiny_model("llama", dtype=torch.float32)
    monkeypatch.setattr(bench_step, "load_target", lambda args: (model, None))
    monkeypatch.setattr(bench_step, "onednn_row_kernels", lambda model: RowKernels(1, 0))
    seen = []
    original = row_kernels.apply_row_kernels
    monkeypatch.setattr(row_kernels, "apply_row_kernels", lambda m, kernels: seen.append(kernels) or original(m, kernels))
    out = tmp_path / "step.json"
    streamed = 3 if streamed_gemm.available() else 0
    bench_step.main(["--rows", "1", "2", "4", "--repeats", "1", "--prefix", "16", "--threads", "1",
                     "--variants", "default", "packed", "lean", "lean-onednn", "--default-rows", "2",
                     "--streamed-rows", str(streamed), "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["default_rows"] == 2 and result["streamed_rows"] == streamed
    assert set(result["variants"]) == {"default", "packed", "lean", "lean-onednn"}
    for by_rows in result["variants"].values():
        assert set(by_rows) == {"1", "2", "4"} and all(parts["forward"] > 0 for parts in by_rows.values())
    assert set(seen) == {RowKernels(2, streamed), RowKernels(1, 0)}  # lean-onednn: without the streamed kernel
    assert f"prepacked variants: {RowKernels(2, streamed).describe()}" in capsys.readouterr().out
