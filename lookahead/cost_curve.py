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
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from .distributed import is_leader, leader_value
from .paths import cache_dir

CURVE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
CURVE_PREFIXES = (256, 1024)  # cache lengths the curve is measured at; other lengths interpolate
CURVE_QUANTILE = 0.25  # a low quantile of repeated timings: machine noise only ever adds time
CURVE_VERSION = 2  # bump when the measurement changes: older cached curves are not reused
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
            return float(np.interp(rows, sizes, ratios))
        slope = (ratios[-1] - ratios[-2]) / (sizes[-1] - sizes[-2])
        return ratios[-1] + slope * (rows - sizes[-1])

    def at(self, prefix_len: int) -> "CostCurve":
        """The curve for a cache of `prefix_len` slots: ratios interpolated linearly between the measured cache
        lengths (clamped to the shortest and longest); `self` when only one length was measured."""
        if not self.by_context:
            return self
        lengths = [self.prefix_len] + [length for length, _ in self.by_context]
        table = np.array([self.ratios] + [ratios for _, ratios in self.by_context])  # [n_lengths, n_sizes]
        ratios = tuple(float(np.interp(prefix_len, lengths, table[:, i])) for i in range(len(self.sizes)))
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


def curve_key(model, batch: int = 1) -> str:
    """Cache key: model config, device, dtype, torch threads, torch version, batch size, the arithmetic in effect
    (prepacked linear layers (`packed_linear`), the attention implementation), the device map of a model split
    by `device_map` and the measurement version."""
    packed = bool(getattr(model, "_lookahead_packed_on", False))
    attention = getattr(model.config, "_attn_implementation", None)
    placement = getattr(model, "hf_device_map", None)  # layers offloaded to disk cost differently
    parts = [model.config.to_json_string(use_diff=False), str(model.device), str(model.dtype),
             str(torch.get_num_threads()), torch.__version__, f"packed={packed}", f"attention={attention}",
             f"v{CURVE_VERSION}"] + ([json.dumps(placement, sort_keys=True, default=str)] if placement else [])
    parts += [f"batch={batch}"] if batch > 1 else []
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


_MEMORY: dict[str, CostCurve] = {}


def cost_curve_for(model, refresh: bool = False, quiet: bool = False, batch: int = 1) -> CostCurve:
    """The model's cost curve for `batch` sequences: from memory, else from the disk cache (re-measured when the
    cached file is unreadable or implausible), else measured (several seconds, progress on stderr) and cached.
    Tensor-parallel ranks (see `distributed.agreement`) take rank 0's cache and decisions and measure together."""
    key = curve_key(model, batch)
    path = cache_dir() / "cost" / f"{key}.json"
    quiet = quiet or not is_leader()
    found = _remembered(key, path, quiet) if not refresh and is_leader() else None
    found = leader_value(found)
    if found is None:
        what = "" if batch == 1 else f" at batch size {batch}"
        _say(quiet, f"lookahead: measuring this model's verification cost curve{what} (cached in {path.parent})")
        found = robust_cost_curve(model, batch, quiet)
        if is_leader():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(found.to_json())
    _MEMORY[key] = found
    return found


def _remembered(key: str, path, quiet: bool) -> CostCurve | None:
    """The curve held in memory or a usable cached file, else None (an unusable file is announced)."""
    if key in _MEMORY:
        return _MEMORY[key]
    if not path.exists():
        return None
    reason = _cached_problem(path)
    if reason is None:
        return CostCurve.from_json(path.read_text())
    _say(quiet, f"lookahead: the cached cost curve {path.name} is unusable ({reason}); measuring again")
    return None


def robust_cost_curve(model, batch: int = 1, quiet: bool = True, attempts: int = 2) -> CostCurve:
    """Measure the curve; measure again (more repeats) while it is implausible; after `attempts` the
    conservative default (with the measured one-row time), announced on stderr. Tensor-parallel ranks measure
    in lockstep and follow rank 0's verdicts."""
    sizes = CURVE_SIZES if batch == 1 else batch_sizes(batch)
    curve = None
    for attempt in range(attempts):
        curve = leader_value(measure_cost_curve(model, sizes, batch=batch, repeats=5 + 4 * attempt))
        reason = implausible(curve)
        if reason is None:
            return curve
        _say(quiet, f"lookahead: implausible cost measurement ({reason}; is the machine busy?)")
    _say(quiet, "lookahead: using a conservative default cost curve; run `lookahead calibrate --refresh` on a "
                "quiet machine")
    return conservative_curve(curve.base_seconds, batch)


def _cached_problem(path) -> str | None:
    """Why a cached curve file cannot be used, or None."""
    try:
        curve = CostCurve.from_json(path.read_text())
    except (OSError, ValueError) as exc:
        return str(exc)
    return None if curve.source == "default" else implausible(curve)


def _say(quiet: bool, message: str) -> None:
    """Print a one-line notice on stderr unless quiet."""
    if not quiet:
        print(message, file=sys.stderr)


@torch.no_grad()
def measure_cost_curve(model, sizes: tuple[int, ...] = CURVE_SIZES, prefixes: tuple[int, ...] = CURVE_PREFIXES,
                       repeats: int = 5, batch: int = 1) -> CostCurve:
    """Time forwards of k rows per sequence for `batch` sequences (with a 4D mask, as in verification) on caches
    of each length in `prefixes` (clamped to the model's context); sizes interleaved within each repeat, a low
    quantile per size, made non-decreasing in k."""
    limit = context_limit(model) - max(sizes)
    lengths = sorted({max(1, min(p, limit)) for p in prefixes})
    measured = [_measure_at(model, sizes, length, repeats, batch) for length in lengths]
    (first, base), rest = measured[0], measured[1:]
    by_context = tuple((length, ratios) for length, (ratios, _) in zip(lengths[1:], rest))
    return CostCurve(tuple(sizes), first, base, lengths[0], batch, by_context)


def context_limit(model) -> int:
    """The model's context length (positions it can encode), or a large number if its config names none."""
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 20


def _measure_at(model, sizes: tuple[int, ...], prefix_len: int, repeats: int, batch: int):
    """(monotone ratios, one-row seconds) on a `prefix_len` cache."""
    from transformers import DynamicCache

    from .cache import make_compactable  # imports transformers, as the line above

    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (batch, prefix_len), generator=generator).to(model.device)
    cache = DynamicCache(config=model.config)
    make_compactable(cache, model.config, max_slots=0)  # as generation keeps it: sliding layers keep every slot
    model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    for k in sizes:  # warm-up: first calls of a shape pay for kernel selection and allocation
        _time_rows(model, cache, prefix_len, k, vocab)
    times = {k: [] for k in sizes}
    for _ in range(repeats):  # interleave sizes so drifting machine load hits them alike
        for k in sizes:
            times[k].append(_time_rows(model, cache, prefix_len, k, vocab))
    seconds = [float(np.quantile(times[k], CURVE_QUANTILE)) for k in sizes]
    ratios = np.maximum.accumulate(np.array(seconds) / seconds[0])  # more rows never cost less
    return tuple(round(float(r), 4) for r in ratios), seconds[0]


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
