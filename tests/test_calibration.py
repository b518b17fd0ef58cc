"""Tests for lookahead/calibration.py: measuring, the disk cache, robustness, `lookahead calibrate`."""

from __future__ import annotations

import pytest
import torch
from test_cost_curve import POISONED, REAL
from tiny_models import build_tiny_model

from lookahead import calibration
from lookahead.calibration import cost_curve_for, curve_key, curve_sizes, measure_cost_curve
from lookahead.cost_curve import CURVE_SIZES, CostCurve, implausible

FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.01, 1.02, 1.05, 1.1, 1.2), 0.05)


def test_measure_cost_curve_on_a_tiny_model_at_two_cache_lengths():
    model = build_tiny_model("llama", dtype=torch.float32)
    curve = measure_cost_curve(model, sizes=(1, 2, 4), prefixes=(16, 48), repeats=2)
    assert curve.sizes == (1, 2, 4) and curve.ratios[0] == 1.0 and curve.base_seconds > 0
    assert curve.prefix_len == 16 and [n for n, _ in curve.by_context] == [48]
    for ratios in (curve.ratios, curve.by_context[0][1]):
        assert list(ratios) == sorted(ratios)  # made non-decreasing in k


def test_measuring_a_sliding_window_model_past_its_window():
    """The measurement caches keep every slot, as generation does (a sliding-window cache would evict, and its
    rows could not be cropped back)."""
    model = build_tiny_model("mistral", dtype=torch.float32, sliding_window=8)
    curve = measure_cost_curve(model, sizes=(1, 2, 4), prefixes=(16, 48), repeats=1)
    assert curve.prefix_len == 16 and curve.ratios[0] == 1.0


def test_each_size_is_timed_warm(monkeypatch):
    """The forwards right after a larger one run slow (after 24 rows the next one-row forwards took 7.1, 6.9, 6.1,
    5.9, 5.7, then 5.5 ms on the 2-core Intel Xeon): the curve times each size after smaller ones only, as a
    generation's steps follow steps of about their size. Timings here are scripted: a forward within three of a
    larger one costs +1.0."""
    previous = []

    def scripted(model, cache, prefix_len, rows, vocab):
        cold = any(p > rows for p in previous[-3:])
        previous.append(rows)
        return 0.1 * (1 + 0.2 * (rows - 1)) + (1.0 if cold else 0.0)

    monkeypatch.setattr(calibration, "_time_rows", scripted)
    model = build_tiny_model("llama", dtype=torch.float32)
    curve = measure_cost_curve(model, sizes=(1, 2, 4, 8), prefixes=(16,), repeats=3)
    assert curve.base_seconds == pytest.approx(0.1)
    assert curve.ratios == pytest.approx((1.0, 1.2, 1.6, 2.4))


@pytest.mark.parametrize("family, extra", [("llama", {}), ("mistral", {"sliding_window": 8}), ("gemma3", {})])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_measurement_cache_holds_the_prefix_a_prefill_would_without_one(family, extra, batch):
    """`_fill` gives every layer `prefix_len` positions per sequence (sliding layers too: they keep every slot), with
    states of the scale a real prefill's have, and the timed forwards run on it and crop back to it."""
    from transformers import DynamicCache

    from lookahead.cache import make_compactable
    from lookahead.compat import CACHE_KWARG

    model = build_tiny_model(family, dtype=torch.float32, **extra)
    caches = [DynamicCache(config=model.config) for _ in range(2)]
    for cache in caches:
        make_compactable(cache, model.config, max_slots=0)
    with torch.no_grad():
        calibration._fill(model, caches[0], batch, 20, model.config.vocab_size)
        model(torch.randint(0, model.config.vocab_size, (batch, 20)), **{CACHE_KWARG: caches[1]}, use_cache=True)
        for filled, prefilled in zip(caches[0].layers, caches[1].layers):
            assert filled.keys.shape == prefilled.keys.shape and filled.values.shape == prefilled.values.shape
            for ours, real in ((filled.keys, prefilled.keys), (filled.values, prefilled.values)):
                assert 1 / 4 < ours.abs().mean() / real.abs().mean() < 4
        assert calibration._time_rows(model, caches[0], 20, 3, model.config.vocab_size) > 0
    assert caches[0].get_seq_length() == 20


def test_cost_curve_for_caches_on_disk_and_in_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMORY", {})
    calls = []
    monkeypatch.setattr(calibration, "measure_cost_curve",
                        lambda model, sizes, batch, repeats: calls.append(batch) or FLAT)
    model = build_tiny_model("llama")
    assert cost_curve_for(model, quiet=True) == FLAT and len(calls) == 1
    assert cost_curve_for(model, quiet=True) == FLAT and len(calls) == 1  # memory
    monkeypatch.setattr(calibration, "_MEMORY", {})
    assert cost_curve_for(model, quiet=True) == FLAT and len(calls) == 1  # disk
    assert len(list((tmp_path / "cost").glob("*.json"))) == 1
    cost_curve_for(model, refresh=True, quiet=True)
    cost_curve_for(model, quiet=True, batch=4)  # another batch size: its own curve and file
    assert calls == [1, 1, 4] and len(list((tmp_path / "cost").glob("*.json"))) == 2


@pytest.mark.parametrize("rows, batch, sizes", [
    (None, 1, CURVE_SIZES), (17, 1, (1, 2, 4, 8, 12, 16, 24)), (24, 1, (1, 2, 4, 8, 12, 16, 24)),
    (25, 1, (1, 2, 4, 8, 12, 16, 24, 32)), (1, 1, (1, 2, 4)), (3, 1, (1, 2, 4)), (500, 1, CURVE_SIZES),
    (9, 4, (1, 2, 4, 8, 12)), (17, 4, (1, 2, 4, 8, 12, 16)), (None, 64, (1, 2, 4))])
def test_curve_sizes_reach_the_rows_a_step_verifies_and_no_further(rows, batch, sizes):
    assert curve_sizes(rows, batch) == sizes


def test_a_curve_is_measured_to_the_rows_asked_and_further_when_more_are_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMORY", {})
    measured = []

    def measure(model, sizes, batch, repeats):
        measured.append(sizes)
        return CostCurve(sizes, tuple(1.0 + 0.1 * (k - 1) for k in sizes), 0.05)

    monkeypatch.setattr(calibration, "measure_cost_curve", measure)
    model = build_tiny_model("llama")
    assert cost_curve_for(model, quiet=True, rows=17).sizes[-1] == 24
    assert cost_curve_for(model, quiet=True, rows=5).sizes[-1] == 24  # a wider curve serves fewer rows
    monkeypatch.setattr(calibration, "_MEMORY", {})
    assert cost_curve_for(model, quiet=True, rows=9).sizes[-1] == 24  # from the disk as well
    assert cost_curve_for(model, quiet=True, rows=40).sizes[-1] == 48  # measured again, further
    monkeypatch.setattr(calibration, "_MEMORY", {})
    assert cost_curve_for(model, quiet=True).sizes == CURVE_SIZES  # every size (`lookahead calibrate`)
    assert measured == [curve_sizes(17), curve_sizes(40), CURVE_SIZES]


def _use_tmp_cache(tmp_path, monkeypatch, measured):
    """Point the cache at tmp_path and make every measurement return the next of `measured` (recorded)."""
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMORY", {})
    monkeypatch.setattr(calibration, "cost_curve_for", cost_curve_for)  # the real one (conftest injects a curve)
    calls = []
    results = iter(measured)
    monkeypatch.setattr(calibration, "measure_cost_curve",
                        lambda model, sizes, batch, repeats: calls.append(repeats) or next(results))
    return calls


def test_a_poisoned_cache_file_is_detected_and_replaced(tmp_path, monkeypatch, capsys):
    good = CostCurve(CURVE_SIZES, REAL, 0.07)
    calls = _use_tmp_cache(tmp_path, monkeypatch, [good])
    model = build_tiny_model("llama")
    path = tmp_path / "cost" / f"{curve_key(model)}.json"
    path.parent.mkdir(parents=True)
    path.write_text(CostCurve(CURVE_SIZES, POISONED[0], 0.07).to_json())
    assert cost_curve_for(model) == good and len(calls) == 1
    assert "unusable" in capsys.readouterr().err
    assert CostCurve.from_json(path.read_text()) == good
    path.write_text("{not json")  # an unreadable file is replaced too
    monkeypatch.setattr(calibration, "_MEMORY", {})
    calls2 = _use_tmp_cache(tmp_path, monkeypatch, [good])
    assert cost_curve_for(model, quiet=True) == good and len(calls2) == 1


def test_implausible_measurements_are_repeated_then_replaced_by_a_conservative_default(tmp_path, monkeypatch):
    bad = CostCurve(CURVE_SIZES, POISONED[1], 0.07)
    calls = _use_tmp_cache(tmp_path, monkeypatch, [bad, bad])
    model = build_tiny_model("llama")
    curve = cost_curve_for(model, quiet=True)
    assert len(calls) == 2 and calls[1] > calls[0]  # the second try repeats more
    assert curve.source == "default" and curve.base_seconds == 0.07 and implausible(curve) is None
    assert curve.ratio(8) > 2.0  # dear rows: only confident drafts are verified
    monkeypatch.setattr(calibration, "_MEMORY", {})
    assert cost_curve_for(model, quiet=True) == curve and len(calls) == 2  # the stored default is reused


def test_measuring_clamps_the_cache_length_to_a_short_context_model():
    model = build_tiny_model("gpt2", dtype=torch.float32, n_positions=256)
    curve = measure_cost_curve(model, sizes=(1, 2, 64), repeats=1)  # 1024 + 64 positions would not fit
    lengths = [curve.prefix_len] + [n for n, _ in curve.by_context]
    assert max(lengths) + 64 <= 256


def test_calibrate_prints_the_curve_at_each_cache_length(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from lookahead.cli.main import main
    from lookahead import models

    curve = CostCurve(CURVE_SIZES, REAL, 0.07, by_context=((1024, tuple(r * 1.1 if r > 1 else r for r in REAL)),))
    calls = _use_tmp_cache(tmp_path, monkeypatch, [curve, curve])
    monkeypatch.setattr(models, "load_model", lambda path=None: (build_tiny_model("llama", dtype=torch.float32),
                                                                 None))
    for args, expected_calls in ((["calibrate"], 1), (["calibrate"], 1), (["calibrate", "--refresh"], 2)):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert len(calls) == expected_calls
    assert "t(k)/t(1) @ 256" in result.output and "t(k)/t(1) @ 1024" in result.output
    assert "linear layers prepacked" in result.output and "lookahead_tree attention" in result.output


def test_a_model_split_by_device_map_has_its_own_curve(tiny_model):
    model = tiny_model("llama")
    whole = curve_key(model)
    model.hf_device_map = {"model": "cpu", "lm_head": "disk"}
    assert curve_key(model) != whole
