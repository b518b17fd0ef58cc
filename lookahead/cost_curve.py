"""The cost curve: how much a forward of k new rows costs relative to one row; the check that a measured curve is
plausible, the conservative stand-in, and `ObservedCost`, which corrects the curve during a generation from the
generation's own timed steps. Measuring it (model forwards, the disk cache) lives in `calibration.py`, the
planning policy that uses it in `budget.py`.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, replace

import numpy as np

from .distributed import leader_value

CURVE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
CURVE_PREFIXES = (256, 1024)  # cache lengths the curve is measured at; other lengths interpolate
# Used when a measurement stays implausible: assumes extra rows are dear, so speculation needs confident drafts.
CONSERVATIVE_RATIOS = tuple(round(1.0 + (0.6 + 0.12 * (k - 2) if k > 1 else 0.0), 4) for k in CURVE_SIZES)


@dataclass(frozen=True)
class CostCurve:
    """t(k)/t(1) for k new rows per sequence, `batch` sequences, on a cache of `prefix_len` slots;
    `base_seconds` = t(1). `by_context` holds the ratios measured at longer caches, as (prefix_len, ratios)
    pairs (`at` interpolates between them); `source` says where the curve came from ("measured" or
    "default", the conservative stand-in for a measurement that stayed implausible)."""

    sizes: tuple[int, ...]
    ratios: tuple[float, ...]
    base_seconds: float
    prefix_len: int = CURVE_PREFIXES[0]
    batch: int = 1
    by_context: tuple[tuple[int, tuple[float, ...]], ...] = ()
    source: str = "measured"

    def ratio(self, rows: int) -> float:
        """Cost of a forward of `rows` rows relative to one row (linear inter- and extrapolation)."""
        sizes, ratios = self.sizes, self.ratios
        if rows <= sizes[-1]:
            return interpolate(rows, sizes, ratios)
        slope = (ratios[-1] - ratios[-2]) / (sizes[-1] - sizes[-2])
        return ratios[-1] + slope * (rows - sizes[-1])

    def at(self, prefix_len: int) -> "CostCurve":
        """The curve for a cache of `prefix_len` slots: ratios interpolated linearly between the measured cache
        lengths (clamped to the shortest and longest); `self` when only one length was measured."""
        if not self.by_context:
            return self
        lengths = [self.prefix_len] + [length for length, _ in self.by_context]
        columns = zip(self.ratios, *(ratios for _, ratios in self.by_context))  # per size: its ratio at each length
        ratios = tuple(interpolate(prefix_len, lengths, column) for column in columns)
        return replace(self, ratios=ratios, prefix_len=int(prefix_len), by_context=())

    def scaled(self, scale: float) -> "CostCurve":
        """The curve with every extra-row cost (ratio - 1) multiplied by `scale`."""
        if scale == 1.0:
            return self
        return replace(self, ratios=tuple(1.0 + (r - 1.0) * scale for r in self.ratios))

    def to_json(self) -> str:
        """JSON text of the curve (for the on-disk cache and `lookahead calibrate`)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "CostCurve":
        """Inverse of `to_json`. Raises `ValueError` for text that is not a curve."""
        try:
            data = json.loads(text)
            by_context = tuple((int(n), tuple(r)) for n, r in data.get("by_context", ()))
            return cls(tuple(data["sizes"]), tuple(data["ratios"]), float(data["base_seconds"]),
                       int(data["prefix_len"]), int(data.get("batch", 1)), by_context,
                       str(data.get("source", "measured")))
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a cost curve: {exc}") from exc


def interpolate(x: float, xs, ys) -> float:
    """`np.interp(x, xs, ys)` for one point (the same arithmetic: clamped to the ends, else the segment's slope
    times the distance from its left end, plus that end's value), without numpy's per-call cost; the planner asks
    for a few dozen ratios a step. xs: increasing."""
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    j = bisect.bisect_right(xs, x) - 1
    slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j])
    return float(slope * (x - xs[j]) + ys[j])


def implausible(curve: CostCurve) -> str | None:
    """Why the curve cannot be a real measurement, or None if it can.

    A forward of k rows costs at least ~one row (ratio >= 0.8: the rows share one pass over the weights) and at
    most k separate one-row forwards plus slack (ratio <= k + 1); more rows never cost much less than fewer
    (ratio >= 0.75 x the largest ratio of fewer rows). A busy machine during measurement breaks these.
    """
    for _, ratios in ((curve.prefix_len, curve.ratios),) + curve.by_context:
        if len(ratios) != len(curve.sizes) or abs(ratios[0] - 1.0) > 1e-6:
            return "the one-row ratio is not 1"
        peak = 1.0
        for k, r in zip(curve.sizes, ratios):
            if not np.isfinite(r) or r < 0.8 or r > k + 1:
                return f"t({k})/t(1) = {r:.2f} is outside [0.8, {k + 1}]"
            if r < 0.75 * peak:
                return f"t({k})/t(1) = {r:.2f} is far below a smaller row count's {peak:.2f}"
            peak = max(peak, r)
    if not (0.0 < curve.base_seconds < 60.0):
        return f"a one-row step of {curve.base_seconds:.3g} s"
    return None


def conservative_curve(base_seconds: float, batch: int = 1) -> CostCurve:
    """The stand-in used when measuring keeps giving implausible curves (see `CONSERVATIVE_RATIOS`)."""
    return CostCurve(CURVE_SIZES, CONSERVATIVE_RATIOS, base_seconds, CURVE_PREFIXES[0], batch, (), "default")


class ObservedCost:
    """Running forward times of a generation's steps by row count, to correct the measured curve.

    The curve is measured on short synthetic caches; long prompts, hole slots, a wide batch or a machine busier
    (or quieter) than during the measurement make real multi-row steps dearer (or cheaper) than it says.
    `scale()` is how much more the extra rows really cost than the curve predicts, pooled over the row counts
    seen: 1.0 until a plain and a multi-row step were timed, then within [SCALE_RANGE]. Set `curve` to the curve
    of the current context.
    """

    SCALE_RANGE = (0.5, 100.0)
    PRIOR = 0.5  # pseudo-observations of extra cost agreeing with the curve (five steps predicted at +10%)

    def __init__(self, curve: CostCurve | None):
        self.curve, self.seconds, self.counts = curve, {}, {}

    def record(self, rows: int, seconds: float) -> None:
        """Add one forward of `rows` rows per sequence that took `seconds` (rank 0's timing under tensor
        parallelism, so every rank plans alike)."""
        seconds = leader_value(float(seconds))
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else 0.7 * old + 0.3 * seconds
        self.counts[rows] = self.counts.get(rows, 0) + 1

    @property
    def has_plain(self) -> bool:
        """Whether a plain (one row per sequence) step has been timed."""
        return 1 in self.seconds

    @property
    def plain_seconds(self) -> float | None:
        """The running time of a plain (one row per sequence) forward, None until one was timed."""
        return self.seconds.get(1)

    def scale(self) -> float:
        """(PRIOR + Σ n_T·(observed t(T)/t(1) − 1)) / (PRIOR + Σ n_T·(curve ratio(T) − 1)) over the timed row counts
        T > 1 (n_T: how many steps of T rows were timed), clipped to SCALE_RANGE; 1.0 before a plain step was timed.

        Pooling weighs each row count by how often it ran and how much extra cost the curve gave it, and the prior
        keeps a few noisy timings from swinging the planner: two rows predicted at +5% that once took +15% read as
        1.2x, not 3x, while a machine that makes every wide step dearer still shows within a few steps."""
        if self.curve is None or 1 not in self.seconds:
            return 1.0
        plain, observed, predicted = self.seconds[1], self.PRIOR, self.PRIOR
        for rows, seconds in self.seconds.items():
            if rows > 1:
                observed += self.counts[rows] * (seconds / plain - 1.0)
                predicted += self.counts[rows] * max(self.curve.ratio(rows) - 1.0, 0.0)
        low, high = self.SCALE_RANGE
        return min(max(observed / predicted, low), high)

    def corrected(self, curve: CostCurve | None, prefix_len: int) -> CostCurve | None:
        """`curve` at a cache of `prefix_len` slots, its extra-row cost scaled by what the timed steps showed
        (this also makes that context's curve the reference for `scale`)."""
        if curve is None:
            return None
        self.curve = curve.at(prefix_len)
        return self.curve.scaled(self.scale())
