"""The measured cost curve: how much a forward of k new rows costs relative to one row.

Measured once per model / device / dtype / thread count / linear arithmetic with a few short forwards and cached
on disk; `ObservedCost` corrects it during a generation from the generation's own timed steps. The planning
policy that uses it lives in `budget.py`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .paths import cache_dir

CURVE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
CURVE_PREFIX = 256


@dataclass(frozen=True)
class CostCurve:
    """t(k)/t(1) for k new rows per sequence, `batch` sequences, on a cache of `prefix_len` slots;
    `base_seconds` = t(1)."""

    sizes: tuple[int, ...]
    ratios: tuple[float, ...]
    base_seconds: float
    prefix_len: int = CURVE_PREFIX
    batch: int = 1

    def ratio(self, rows: int) -> float:
        """Cost of a forward of `rows` rows relative to one row (linear inter- and extrapolation)."""
        sizes, ratios = self.sizes, self.ratios
        if rows <= sizes[-1]:
            return float(np.interp(rows, sizes, ratios))
        slope = (ratios[-1] - ratios[-2]) / (sizes[-1] - sizes[-2])
        return ratios[-1] + slope * (rows - sizes[-1])

    def to_json(self) -> str:
        """JSON text of the curve (for the on-disk cache and `lookahead calibrate`)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "CostCurve":
        """Inverse of `to_json`."""
        data = json.loads(text)
        return cls(tuple(data["sizes"]), tuple(data["ratios"]), data["base_seconds"], data["prefix_len"],
                   data.get("batch", 1))


def curve_key(model, batch: int = 1) -> str:
    """Cache key: model config, device, dtype, torch threads, torch version and batch size."""
    parts = [model.config.to_json_string(use_diff=False), str(model.device), str(model.dtype),
             str(torch.get_num_threads()), torch.__version__] + ([f"batch={batch}"] if batch > 1 else [])
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


_MEMORY: dict[str, CostCurve] = {}


def cost_curve_for(model, refresh: bool = False, quiet: bool = False, batch: int = 1) -> CostCurve:
    """The model's cost curve for `batch` sequences: from memory, else from the disk cache, else measured (a few
    seconds) and cached."""
    key = curve_key(model, batch)
    path = cache_dir() / "cost" / f"{key}.json"
    if not refresh and key in _MEMORY:
        return _MEMORY[key]
    if not refresh and path.exists():
        _MEMORY[key] = CostCurve.from_json(path.read_text())
        return _MEMORY[key]
    if not quiet:
        what = "" if batch == 1 else f" at batch size {batch}"
        print(f"lookahead: measuring this model's verification cost curve{what} once (cached in "
              f"{path.parent})", file=sys.stderr)
    sizes = CURVE_SIZES if batch == 1 else batch_sizes(batch)
    curve = measure_cost_curve(model, sizes, batch=batch)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(curve.to_json())
    _MEMORY[key] = curve
    return curve


@torch.no_grad()
def measure_cost_curve(model, sizes: tuple[int, ...] = CURVE_SIZES, prefix_len: int = CURVE_PREFIX,
                       repeats: int = 5, batch: int = 1) -> CostCurve:
    """Time forwards of k rows per sequence for `batch` sequences (with a 4D mask, as in verification) on a
    `prefix_len` cache; median per k."""
    from transformers import DynamicCache

    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (batch, prefix_len), generator=generator).to(model.device)
    cache = DynamicCache(config=model.config)
    model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    medians = {}
    for _ in range(repeats):  # interleave sizes so drifting machine load hits them alike
        for k in sizes:
            medians.setdefault(k, []).append(_time_rows(model, cache, prefix_len, k, vocab))
    seconds = [float(np.median(medians[k])) for k in sizes]
    ratios = tuple(round(s / seconds[0], 4) for s in seconds)
    return CostCurve(tuple(sizes), ratios, seconds[0], prefix_len, batch)


def batch_sizes(batch: int) -> tuple[int, ...]:
    """The rows per sequence a batch curve measures: CURVE_SIZES up to 64 rows in all (at least 1, 2, 4)."""
    return tuple(k for k in CURVE_SIZES if k <= max(4, 64 // batch))


def _time_rows(model, cache, prefix_len: int, rows: int, vocab: int) -> float:
    """Seconds for one forward of `rows` new rows per sequence on the cache (cropped back afterwards)."""
    batch = cache.layers[0].keys.shape[0]
    ids = torch.randint(0, vocab, (batch, rows)).to(model.device)
    positions = torch.arange(prefix_len, prefix_len + rows, device=model.device).view(1, -1).expand(batch, -1)
    mask = None if rows == 1 else torch.zeros(batch, 1, rows, prefix_len + rows, dtype=model.dtype,
                                              device=model.device)
    start = time.perf_counter()
    model(ids, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True)
    elapsed = time.perf_counter() - start
    cache.crop(-rows)
    return elapsed


class ObservedCost:
    """Running forward times of a generation's batch steps by row count, to correct the measured curve.

    The curve is measured once on a 256-token cache; long prompts, hole slots and a wide batch can make real
    multi-row steps dearer than it says. `scale()` is how much more the extra rows really cost than the curve
    predicts (1.0 until both a plain and a multi-row step were seen).
    """

    def __init__(self, curve: CostCurve | None):
        self.curve, self.seconds = curve, {}

    def record(self, rows: int, seconds: float) -> None:
        """Add one forward of `rows` rows per sequence that took `seconds`."""
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else 0.7 * old + 0.3 * seconds

    @property
    def has_plain(self) -> bool:
        """Whether a plain (one row per sequence) step has been timed."""
        return 1 in self.seconds

    def scale(self) -> float:
        """max over timed row counts T > 1 of (observed t(T)/t(1) - 1) / (curve ratio(T) - 1), at least 1."""
        if self.curve is None or 1 not in self.seconds:
            return 1.0
        plain, worst = self.seconds[1], 1.0
        for rows, seconds in self.seconds.items():
            predicted = self.curve.ratio(rows) - 1.0
            if rows > 1 and predicted > 1e-6:
                worst = max(worst, (seconds / plain - 1.0) / predicted)
        return worst
