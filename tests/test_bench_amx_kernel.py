"""Smoke test of benchmarks/bench_amx_kernel.py on the default model's first layer, and on its LM head with `--head`
(a CPU with AMX, and AMX-INT8 for the head, only): both kernels timed and checked against float64 (no timing is
asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_amx_kernel  # noqa: E402  (the benchmarks folder is not a package)

from lookahead import amx_int8, amx_kernel  # noqa: E402


@pytest.mark.skipif(not amx_kernel.available(), reason="needs a CPU with AMX and AVX-512")
def test_the_benchmark_times_both_kernels_and_checks_their_products(tmp_path, capsys):
    out = tmp_path / "amx.json"
    bench_amx_kernel.main(["--rows", "1", "3", "--repeats", "1", "--layers", "1", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["mode"]) for r in results] == [(1, "cached"), (1, "streamed"), (3, "cached"),
                                                         (3, "streamed")]
    assert all(r["amx4_ms"] > 0 and r["affine4h_ms"] > 0 for r in results)
    assert all(r["amx4_error"] < 2e-6 and r["affine4h_error"] < 2e-6 for r in results)
    assert "amx4 / affine4h" in capsys.readouterr().out


@pytest.mark.skipif(not amx_int8.available(), reason="needs a CPU with AMX-INT8 and AVX-512")
def test_with_head_it_times_the_lm_head_on_both_kernels(tmp_path, capsys):
    out = tmp_path / "head.json"
    bench_amx_kernel.main(["--head", "--rows", "2", "--repeats", "1", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["mode"]) for r in results] == [(2, "cached"), (2, "evicted")]
    assert all(r["amx8_ms"] > 0 and r["scaled8_ms"] > 0 for r in results)
    assert all(r["amx8_error"] < 2e-6 and r["scaled8_error"] < 2e-6 for r in results)
    assert "amx8 / scaled8" in capsys.readouterr().out
