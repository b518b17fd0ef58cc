"""Tests for lookahead/row_kernels.py: which kernel computes how many rows, measured on a fake clock (no timing of
this machine is asserted), its cache and the curve key."""

from __future__ import annotations

import collections
import types

import pytest
import torch
from tiny_models import build_tiny_model

from lookahead import row_kernels, streamed_gemm
from lookahead.calibration import curve_key
from lookahead.packed_linear import packed_linears, set_default_rows, set_streamed_rows
from lookahead.row_kernels import RowKernels, measure_row_kernels, row_kernels_for

WEIGHTS = 9  # packed weights of the tiny llama (2 layers × q/k/v, o, gate/up, down, and the LM head)
TOP = row_kernels.STREAMED_PROBES[-1]  # the largest row count the streamed kernel is probed at


class _FakeClock:
    """A clock the fake kernels advance by `ms[kernel](rows)` per pass over all packed weights."""

    def __init__(self, ms: dict):
        self.now, self.ms, self.calls = 0.0, ms, {name: 0 for name in ms}
        self.passes = collections.Counter()  # (kernel, rows) -> products computed, over all weights

    def perf_counter(self) -> float:
        return self.now

    def install(self, monkeypatch) -> None:
        from lookahead import packed_linear

        for name in self.ms:
            monkeypatch.setattr(packed_linear, f"{name}_product", self._kernel(name))
        monkeypatch.setattr(row_kernels, "time", types.SimpleNamespace(perf_counter=self.perf_counter))

    def _kernel(self, name):
        def product(x, packed):
            self.calls[name] += 1
            self.passes[name, x.shape[0]] += 1
            self.now += self.ms[name](x.shape[0]) / 1000 / WEIGHTS
        return product


def _measure(monkeypatch, ms: dict, streamed: bool = True, tiles: bool = True,
             **kwargs) -> tuple[RowKernels, _FakeClock]:
    """`measure_row_kernels` of a tiny model on fake kernels taking `ms[kernel](rows)` per pass; `tiles`: its
    weights count as held for the AMX kernels (the streamed kernel is then a candidate for large products)."""
    clock = _FakeClock({"onednn": ms["default"], **ms})  # unpacked oneDNN ties with the default matmul unless given
    clock.install(monkeypatch)
    monkeypatch.setattr(streamed_gemm, "available", lambda: streamed)
    monkeypatch.setattr(row_kernels, "_tiled", lambda weights: tiles)
    model = build_tiny_model("llama", dtype=torch.float32)
    with packed_linears(model):
        return measure_row_kernels(model, **kwargs), clock


STREAM_FAST = lambda r: 2.0 + 0.01 * r if r <= TOP else 3.0 * r  # noqa: E731 — nearly flat, slow for a prefill
ONEDNN = lambda r: 2.5 + 0.1 * r  # noqa: E731


@pytest.mark.parametrize("default_ms, expected", [(lambda r: 1.0 * r, RowKernels(1, TOP)),
                                                  (lambda r: 3.0, RowKernels(0, TOP)),
                                                  (lambda r: 1.5 if r != 2 else 9.0, RowKernels(1, 2))])
def test_the_default_matmul_takes_the_rows_where_it_beats_the_streamed_kernel(monkeypatch, default_ms, expected):
    found, clock = _measure(monkeypatch, {"default": default_ms, "packed": ONEDNN, "streamed": STREAM_FAST},
                            repeats=2)
    assert found == expected
    assert clock.calls["packed"] == 0  # oneDNN is neither timed nor built when the streamed kernel is used


def test_without_the_streamed_kernel_the_default_matmul_is_weighed_against_onednn(monkeypatch):
    found, clock = _measure(monkeypatch, {"default": lambda r: 1.6 + 0.4 * r, "packed": ONEDNN,
                                          "streamed": STREAM_FAST}, streamed=False, repeats=2)
    assert found == RowKernels(2, 0) and clock.calls["streamed"] == 0


@pytest.mark.parametrize("streamed_ms, expected", [(STREAM_FAST, RowKernels(0, TOP)),
                                                   (lambda r: 2.0 if r <= 8 else 9.0, RowKernels(0, 8)),
                                                   (lambda r: 9.0 if r == 1 else 2.0, RowKernels(1, TOP, "streamed")),
                                                   (lambda r: 0.97 * 5.0, RowKernels(0, TOP))])
def test_the_streamed_kernel_takes_the_probes_up_to_the_first_where_the_default_matmul_clearly_wins(
        monkeypatch, streamed_ms, expected):
    """Above the default matmul's rows the streamed kernel keeps a probe unless the default matmul (what computes
    the larger products then) needs at most KERNEL_MARGIN of its time there."""
    found, _ = _measure(monkeypatch, {"default": lambda r: 5.0, "packed": ONEDNN, "streamed": streamed_ms},
                        repeats=2)
    assert found == expected


def test_a_streamed_kernel_that_never_wins_hands_the_choice_to_the_default_matmul_and_onednn(monkeypatch):
    found, clock = _measure(monkeypatch, {"default": lambda r: 1.0, "packed": ONEDNN, "streamed": STREAM_FAST},
                            repeats=2)
    assert found == RowKernels(4, 0)  # the default matmul wins up to its 4 rows, oneDNN computes the rest
    assert clock.calls["packed"] > 0


@pytest.mark.parametrize("onednn_ms, expected, rounds", [(lambda r: 0.5 * r, "onednn", 1),
                                                         (lambda r: 0.97 * r, "default", row_kernels.LARGE_ROUNDS),
                                                         (lambda r: 2.0 * r, "default", 1)])
def test_products_above_the_streamed_rows_take_unpacked_onednn_where_it_clearly_beats_the_default_matmul(
        monkeypatch, onednn_ms, expected, rounds):
    found, clock = _measure(monkeypatch, {"default": lambda r: 1.0 * r, "packed": ONEDNN, "streamed": STREAM_FAST,
                                          "onednn": onednn_ms}, repeats=2)
    assert found == RowKernels(1, TOP, expected)
    # a warm-up and the timed rounds: one when the first shows one kernel at half the other's time or less
    assert clock.calls["onednn"] == (1 + rounds) * WEIGHTS
    assert clock.calls["packed"] == 0


@pytest.mark.parametrize("large_ms, expected", [(lambda r: 0.4 * r, "streamed"), (lambda r: 0.97 * r, "default")])
def test_products_above_the_streamed_rows_stay_on_the_streamed_kernel_where_it_clearly_beats_the_others(
        monkeypatch, large_ms, expected):
    """A streamed kernel that computes a prefill's LARGE_PROBE rows in at most KERNEL_MARGIN of the default matmul's
    time (and faster than oneDNN) computes every row count (the AMX kernels)."""
    streamed = lambda r: STREAM_FAST(r) if r <= TOP else large_ms(r)  # noqa: E731
    found, clock = _measure(monkeypatch, {"default": lambda r: 1.0 * r, "packed": ONEDNN, "streamed": streamed,
                                          "onednn": lambda r: 0.5 * r}, repeats=2)
    assert found == RowKernels(1, TOP, expected if expected == "streamed" else "onednn")
    assert clock.passes["streamed", row_kernels.LARGE_PROBE] > 0


def test_without_the_amx_kernels_large_products_never_time_the_streamed_kernel(monkeypatch):
    """The other streamed kernels take a few rows a pass over the weights: a prefill on them is not timed."""
    found, clock = _measure(monkeypatch, {"default": lambda r: 1.0 * r, "packed": ONEDNN, "streamed": STREAM_FAST,
                                          "onednn": lambda r: 0.5 * r}, tiles=False, repeats=2)
    assert found == RowKernels(1, TOP, "onednn") and clock.passes["streamed", row_kernels.LARGE_PROBE] == 0


def test_without_the_streamed_kernel_unpacked_onednn_is_not_timed(monkeypatch):
    found, clock = _measure(monkeypatch, {"default": lambda r: 1.0, "packed": ONEDNN, "streamed": STREAM_FAST,
                                          "onednn": lambda r: 0.1}, streamed=False, repeats=2)
    assert found == RowKernels(4, 0) and clock.calls["onednn"] == 0


def test_nothing_packable_measures_nothing():
    assert measure_row_kernels(build_tiny_model("llama", dtype=torch.float64)) == RowKernels()


def test_a_model_that_streams_slowly_gets_fewer_rounds(monkeypatch):
    slow = lambda r: 900.0  # noqa: E731 — a pass over the weights takes ~1 s: a round ~20 s
    found, clock = _measure(monkeypatch, {"default": slow, "packed": slow, "streamed": slow}, repeats=7,
                            budget_seconds=3.0)
    assert found == RowKernels(0, TOP)  # a tie: the streamed kernel keeps its rows
    rows = len(set(range(1, row_kernels.MAX_DEFAULT_ROWS + 1)) | set(row_kernels.STREAMED_PROBES))
    assert clock.calls["default"] == (1 + 2 * rows) * WEIGHTS + (1 + 1) * WEIGHTS  # a warm-up at 1 row and the
    # minimum of 2 timed rounds, not 7; for the large product a warm-up and 1 round, not LARGE_ROUNDS


def test_row_counts_the_first_round_settles_are_not_timed_again(monkeypatch):
    """Where one kernel took at most SETTLED_RATIO of the other's time in the first timed round, the row count is
    decided either way; the rounds after it time only the row counts still in question."""
    default = lambda r: 20.0 if r <= 3 else 0.5 if r == 4 else 2.1 + 0.01 * r  # noqa: E731
    found, clock = _measure(monkeypatch, {"default": default, "packed": ONEDNN, "streamed": STREAM_FAST},
                            repeats=5, budget_seconds=1e9)
    assert found == RowKernels(0, 2)  # the streamed kernel wins 1–3 rows by 10x, loses 4 rows by 4x
    for kernel in ("default", "streamed"):
        for rows in (1, 2, 3, 4):  # settled: one timed pass (and the warm-up's, at 1 row)
            assert clock.passes[kernel, rows] == (1 + (rows == 1)) * WEIGHTS
        for rows in (8, TOP):  # within 5% of each other: every round
            assert clock.passes[kernel, rows] == 5 * WEIGHTS


def test_the_warm_up_calls_each_kernel_once_and_onednn_at_every_shape(monkeypatch):
    """First calls build layouts and load kernels, untimed: the default matmul (and the streamed kernel) at its
    fewest rows only, oneDNN, which sets up a primitive per product shape, at every row count it is timed at."""
    tie = lambda r: 1000.0  # noqa: E731 — nothing settles: the minimum of 2 timed rounds
    _, clock = _measure(monkeypatch, {"default": tie, "packed": tie, "streamed": tie}, streamed=False, repeats=2)
    for rows in range(1, row_kernels.MAX_DEFAULT_ROWS + 1):
        assert clock.passes["packed", rows] == (1 + 2) * WEIGHTS
        assert clock.passes["default", rows] == (2 + (rows == 1)) * WEIGHTS


def test_row_kernels_for_caches_on_disk_and_in_memory_and_keys_the_curve(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(row_kernels, "_MEMORY", {})
    calls = []
    monkeypatch.setattr(row_kernels, "measure_row_kernels", lambda model: calls.append(1) or RowKernels(3, 16))
    monkeypatch.setattr(streamed_gemm, "available", lambda: True)
    model = build_tiny_model("llama", dtype=torch.float32)
    with packed_linears(model):
        assert row_kernels_for(model, quiet=True) == RowKernels(3, 16) and len(calls) == 1
        assert row_kernels_for(model, quiet=True) == RowKernels(3, 16) and len(calls) == 1  # memory
        monkeypatch.setattr(row_kernels, "_MEMORY", {})
        assert row_kernels_for(model, quiet=True) == RowKernels(3, 16) and len(calls) == 1  # disk
        assert row_kernels_for(model, refresh=True, quiet=True) == RowKernels(3, 16) and len(calls) == 2
        files = list((tmp_path / "cost").glob("*-row-kernels.json"))
        assert len(files) == 1
        for bad in ('{"default_rows": -4, "streamed_rows": 0, "large": "default"}', '{"default_rows": 1}', "not json",
                    '{"default_rows": 1, "streamed_rows": 99, "large": "default"}',
                    '{"default_rows": 1, "streamed_rows": 16}', '{"default_rows": 1, "streamed_rows": 16, "large": 3}'):
            files[0].write_text(bad)  # unreadable or out of range: measured again
            monkeypatch.setattr(row_kernels, "_MEMORY", {})
            before = len(calls)
            assert row_kernels_for(model, quiet=True) == RowKernels(3, 16) and len(calls) == before + 1
        keys = {curve_key(model)}
        set_default_rows(model, 3)
        keys.add(curve_key(model))
        if streamed_gemm.available():
            set_streamed_rows(model, 16)
            keys.add(curve_key(model))
    assert len(keys) == 3  # a curve measured with other kernels for a few rows is cached apart


def test_a_cached_streamed_choice_is_not_used_where_the_kernel_is_missing(tmp_path):
    path = tmp_path / "k.json"
    path.write_text('{"default_rows": 1, "streamed_rows": 16, "large": "onednn"}')
    assert row_kernels._read(path, streamed=True) == RowKernels(1, 16, "onednn")
    assert row_kernels._read(path, streamed=False) is None
    path.write_text('{"default_rows": 1, "streamed_rows": 0, "large": "default"}')
    assert row_kernels._read(path, streamed=False) == RowKernels(1, 0)


def test_describe_names_each_kernel_and_its_rows():
    assert RowKernels(0, 0).describe() == "all products on oneDNN's packed weights"
    assert RowKernels(3, 0).describe() == "up to 3 rows on PyTorch's default matmul, more on oneDNN's packed weights"
    assert RowKernels(0, 16).describe() == "1–16 rows on the streamed kernel, more on PyTorch's default matmul"
    assert RowKernels(2, 3).describe() == ("up to 2 rows on PyTorch's default matmul, 3 rows on the streamed kernel, "
                                           "more on PyTorch's default matmul")
    assert RowKernels(0, 64, "onednn").describe() == "1–64 rows on the streamed kernel, more on oneDNN (unpacked)"
    assert RowKernels(0, 64, "streamed").describe("the AMX kernel") == "all rows on the AMX kernel"
    assert RowKernels(2, 64, "streamed").describe() == ("up to 2 rows on PyTorch's default matmul, more on the "
                                                        "streamed kernel")
    assert RowKernels(2, 0, "onednn").describe() == ("up to 2 rows on PyTorch's default matmul, more on oneDNN's "
                                                     "packed weights")
