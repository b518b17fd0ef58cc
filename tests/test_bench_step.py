"""Smoke test of benchmarks/bench_step.py on a tiny model: every variant and row count is timed, the prepacked
variants compute products of up to `--default-rows` rows with the default matmul, and the table says so (no timing
is asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tiny_models import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_step  # noqa: E402  (the benchmarks folder is not a package)


def test_step_benchmark_runs_every_variant_with_the_given_default_rows(tmp_path, capsys, monkeypatch):
    from lookahead import packed_linear

    model = build_tiny_model("llama", dtype=torch.float32)
    monkeypatch.setattr(bench_step, "load_target", lambda args: (model, None))
    seen = []
    original = packed_linear.set_default_rows
    monkeypatch.setattr(packed_linear, "set_default_rows", lambda m, rows: seen.append(rows) or original(m, rows))
    out = tmp_path / "step.json"
    bench_step.main(["--rows", "1", "2", "4", "--repeats", "1", "--prefix", "16",
                     "--threads", "1", "--variants", "default", "packed", "lean", "--default-rows", "2",
                     "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["default_rows"] == 2 and set(result["variants"]) == {"default", "packed", "lean"}
    for by_rows in result["variants"].values():
        assert set(by_rows) == {"1", "2", "4"} and all(parts["forward"] > 0 for parts in by_rows.values())
    assert 2 in seen  # the prepacked variants ran with the default matmul for up to 2 rows
    assert "products of up to 2 rows on PyTorch's default matmul" in capsys.readouterr().out
