"""Smoke test of benchmarks/bench_dispatch.py: every operation timed warm and cold and its dispatches counted; the
RoPE and RMS-norm forms give the same numbers; lookahead's forms dispatch fewer operations than transformers'
(no timing is asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_dispatch  # noqa: E402  (the benchmarks folder is not a package)


def test_dispatch_benchmark_runs_and_counts_operations(tmp_path, capsys):
    out = tmp_path / "dispatch.json"
    bench_dispatch.main(["--repeats", "3", "--stream-mb", "0.5", "--rows", "2", "--threads", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    ops = result["operations"]
    assert set(ops) == set(bench_dispatch.operations(2))
    assert all(m["warm_us"] > 0 and m["cold_us"] > 0 and m["dispatched"] >= 1 for m in ops.values())
    assert ops["RoPE, sign folded into the sin (used)"]["dispatched"] < ops["RoPE, q and k as one"]["dispatched"] \
        < ops["RoPE, transformers (q, k apart)"]["dispatched"]
    assert ops["RMS norm, LeanNorm (used)"]["dispatched"] < ops["RMS norm, torch.rms_norm"]["dispatched"]
    assert "cold / warm" in capsys.readouterr().out
    assert "cpu_flags" in result["machine"]


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--stream-mb", "0"], ["--rows", "-1"]])
def test_dispatch_benchmark_rejects_bad_counts(argv, capsys):
    with pytest.raises(SystemExit):
        bench_dispatch.main(argv)
    assert "must be" in capsys.readouterr().err
