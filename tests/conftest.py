"""Shared fixtures: tiny random causal LMs built in-process from a config (no downloads)."""

from __future__ import annotations

import os

from dataclasses import replace

import pytest
import torch
from tiny_models import build_tiny_model

# Triton has no CPU backend: kernels run under its interpreter, which must be switched on before triton is
# first imported anywhere in the session (transformers imports it early).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Commands the tests start never compile the kernels in a helper process (`kernel_warmup`) unless a test asks.
os.environ["LOOKAHEAD_KERNEL_WARMUP"] = "0"

# noqa: E402 below: imported after TRITON_INTERPRET is set (transformers imports triton)
from lookahead import (budget, calibration, decoder, hf, rest, row_kernels, streamed_gemm,  # noqa: E402
                       thread_governor)
from lookahead.cost_curve import CURVE_SIZES, CostCurve  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model():
    """The `build_tiny_model(family=..., dtype=..., seed=..., vocab=..., layers=..., **overrides)` factory."""
    return build_tiny_model


# Tests never measure a cost curve on the machine running them: generation plans on this injected curve (shaped
# like the goal on a CPU: 8 rows ~1.2x, 16 rows ~1.4x a one-row step). Tests of the measurement itself call
# `lookahead.calibration` functions directly.
INJECTED_CURVE = CostCurve(CURVE_SIZES, (1.0, 1.05, 1.1, 1.2, 1.3, 1.4, 1.7, 2.0, 2.6, 3.2), 0.05)
# ... and products of one or two rows run PyTorch's default matmul, 3–5 rows the streamed kernel, larger ones
# oneDNN on the layers' own weights (the streamed kernel is in use, so no oneDNN copy is made; prefills take it), so
# every kernel computes in generations that speculate (a machine where the streamed kernel cannot be built skips
# it, and products of 3+ rows run oneDNN's packed weights there; `test_streamed_gemm` fails there if the CPU has
# FMA). Tests that pin `streamed_matmul_rows=0` run oneDNN's packed weights.
INJECTED_ROW_KERNELS = row_kernels.RowKernels(2, 5 if streamed_gemm.available() else 0, "onednn")


@pytest.fixture(autouse=True)
def injected_cost_curve(monkeypatch):
    """Every `Lookahead` call in a test plans on INJECTED_CURVE (for any batch size) with INJECTED_ROW_KERNELS, and
    so does code that asks `lookahead.calibration` or `lookahead.row_kernels` at call time (the benchmark scripts):
    nothing is measured on the machine running the tests, or written into the user's cache (tests of the
    measurement restore the originals)."""
    for module in (hf, calibration):
        monkeypatch.setattr(module, "cost_curve_for", lambda model, refresh=False, quiet=False, batch=1, rows=None:
                            replace(INJECTED_CURVE, batch=batch))
    for module in (hf, row_kernels):
        monkeypatch.setattr(module, "row_kernels_for", lambda model, refresh=False, quiet=False:
                            INJECTED_ROW_KERNELS)
    return INJECTED_CURVE


@pytest.fixture(autouse=True)
def no_resting_on_timings(monkeypatch):
    """Generations in tests never rest their drafters on the timings of the machine running them (`rest.py` follows
    wall-clock step times): each decoder gets a `DraftRest` that never rests. `tests/test_rest.py` scripts the
    resting and calls the policy with injected timings."""
    monkeypatch.setattr(decoder, "DraftRest", lambda enabled: rest.DraftRest(False))


@pytest.fixture(autouse=True)
def steps_timed_by_the_curve(monkeypatch):
    """Generations in tests correct their cost curve by the step times the curve itself predicts, not by the wall
    clock of the machine running them (`budget.BatchPlanner.record`, fed by the decoder after every forward): the
    plan, and so tokens per step, depends on the tokens alone, also on a loaded machine. The step after the first,
    unrecorded `budget.COLD_FORWARDS` is still a plain one. `tests/test_cost_curve.py` and
    `tests/test_batch.py` give `ObservedCost` their own timings."""
    own = budget.BatchPlanner.record

    def record(self, rows: int, seconds: float) -> None:
        curve = self.observed.curve
        own(self, rows, curve.ratio(rows) if curve is not None else 1.0)

    monkeypatch.setattr(budget.BatchPlanner, "record", record)


class CurveTimedGovernor(thread_governor.ThreadGovernor):
    """A `ThreadGovernor` that sees every step take the time the cost curve predicts and no other process busy
    (never a busy machine)."""

    def busy_elsewhere(self) -> float:
        return 0.0

    def record(self, rows: int, seconds: float) -> bool:
        if self.curve is not None:
            seconds = self.curve.base_seconds * self.curve.ratio(rows)
        return super().record(rows, seconds)


@pytest.fixture(autouse=True)
def threads_timed_by_the_curve(monkeypatch):
    """Generations in tests never change their thread count on the timings of the machine running them (a loaded
    CI machine would otherwise move steps to one thread): each gets a fresh `CurveTimedGovernor`.
    `tests/test_thread_governor.py` scripts the switches."""
    monkeypatch.setattr(hf, "governor_for", lambda model: CurveTimedGovernor())
