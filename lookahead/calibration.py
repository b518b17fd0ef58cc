"""Measuring the cost curve (`cost_curve.CostCurve`): timed forwards of k rows on synthetic caches, measured again
while implausible, cached in memory and on disk per model / device / dtype / thread count / linear arithmetic
(`lookahead calibrate` prints it). A generation asks for the rows its configuration can verify in a step, and the
curve is measured up to there (`curve_sizes`; further when a later configuration asks for more): the sizes above a
default step's 17 rows took two thirds of the measurement on the 2-core AVX2 machine. Tensor-parallel ranks take rank
0's cache and verdicts and measure in lockstep.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np
import torch

from .compat import CACHE_KWARG
from .cost_curve import CURVE_PREFIXES, CURVE_SIZES, CostCurve, conservative_curve, implausible
from .distributed import is_leader, leader_value
from .paths import cache_dir

CURVE_QUANTILE = 0.25  # a low quantile of repeated timings: machine noise only ever adds time
# Untimed one-row forwards before each pass: after a forward of many rows the next few one-row forwards run slow
# (on the 2-core Intel Xeon after 24 rows: 7.1, 6.9, 6.1, 5.9, 5.7 then 5.5 ms), which made the one-row time of
# a pass that followed the largest size high and every ratio ~15% low (docs/step-cost.md, "Session 52").
WARM_FORWARDS = 5
# bump when the measurement, the arithmetic or the kernels change: older cached curves are not reused
CURVE_VERSION = 14


def curve_key(model, batch: int = 1) -> str:
    """Cache key: model config, device, dtype, torch threads, torch version, the device map of a model split by
    `device_map`, the arithmetic in effect (prepacked linear layers (`packed_linear`) and which kernel computes
    products of how many rows (`row_kernels`), lean decoder layers (`lean_layers`), the attention implementation), the
    measurement version and the batch size."""
    packed = bool(getattr(model, "_lookahead_packed_on", False))
    lean = bool(getattr(model, "_lookahead_lean_on", False))
    attention = getattr(model.config, "_attn_implementation", None)
    parts = model_parts(model) + [f"packed={packed}", f"lean={lean}", f"attention={attention}", f"v{CURVE_VERSION}",
                                   f"default_rows={getattr(model, '_lookahead_default_rows', 0)}",
                                   f"streamed_rows={getattr(model, '_lookahead_streamed_rows', 0)}",
                                   f"compact={getattr(model, '_lookahead_compact_weights', False)}"]
    parts += [f"batch={batch}"] if batch > 1 else []
    return digest(parts)


def model_parts(model) -> list[str]:
    """What any timing of the model's products depends on: config, device, dtype, torch threads and version, and
    the device map of a split model (layers offloaded to disk cost differently)."""
    parts = [model.config.to_json_string(use_diff=False), str(model.device), str(model.dtype),
             str(torch.get_num_threads()), torch.__version__]
    placement = getattr(model, "hf_device_map", None)
    return parts + ([json.dumps(placement, sort_keys=True, default=str)] if placement else [])


def digest(parts: list[str]) -> str:
    """A short hex digest of `parts`."""
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


_MEMORY: dict[str, CostCurve] = {}


def cost_curve_for(model, refresh: bool = False, quiet: bool = False, batch: int = 1,
                   rows: int | None = None) -> CostCurve:
    """The model's cost curve for `batch` sequences: from memory, else from the disk cache (re-measured when the
    cached file is unreadable or implausible), else measured (several seconds, progress on stderr) and cached.
    `rows`, the most rows per sequence a step of the caller's configuration verifies, limits a new measurement to
    the sizes up to the first that reaches it (`curve_sizes`: the larger ones cost most to time and would never be
    used); a curve found that does not reach `rows` is measured again to it, so every curve in use is measured where
    it is read. None measures every size. Tensor-parallel ranks (see `distributed.agreement`) take rank 0's cache and
    decisions and measure together."""
    key = curve_key(model, batch)
    path = cache_dir() / "cost" / f"{key}.json"
    quiet = quiet or not is_leader()
    sizes = curve_sizes(rows, batch)
    found = _remembered(key, path, quiet) if not refresh and is_leader() else None
    found = found if found is not None and found.sizes[-1] >= sizes[-1] else None
    found = leader_value(found)
    if found is None:
        what = "" if batch == 1 else f" at batch size {batch}"
        say(quiet, f"lookahead: measuring this model's verification cost curve{what} (cached in {path.parent})")
        found = robust_cost_curve(model, batch, quiet, sizes=sizes)
        if is_leader():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(found.to_json())
    _MEMORY[key] = found
    return found


def curve_sizes(rows: int | None = None, batch: int = 1) -> tuple[int, ...]:
    """The rows per sequence a curve of `batch` sequences measures: CURVE_SIZES up to 64 rows in all
    (`batch_sizes`), and, when `rows` is given, only up to the first size that reaches `rows` (at least 1, 2, 4)."""
    sizes = CURVE_SIZES if batch == 1 else batch_sizes(batch)
    if rows is None:
        return sizes
    reach = next((i for i, k in enumerate(sizes) if k >= rows), len(sizes) - 1)
    return sizes[:max(reach + 1, 3)]


def _remembered(key: str, path, quiet: bool) -> CostCurve | None:
    """The curve held in memory or a usable cached file, else None (an unusable file is announced)."""
    if key in _MEMORY:
        return _MEMORY[key]
    if not path.exists():
        return None
    reason = _cached_problem(path)
    if reason is None:
        return CostCurve.from_json(path.read_text())
    say(quiet, f"lookahead: the cached cost curve {path.name} is unusable ({reason}); measuring again")
    return None


def robust_cost_curve(model, batch: int = 1, quiet: bool = True, attempts: int = 2,
                      sizes: tuple[int, ...] | None = None) -> CostCurve:
    """Measure the curve at `sizes` rows per sequence (None: `curve_sizes` for `batch`); measure again (more
    repeats) while it is implausible; after `attempts` the conservative default (with the measured one-row time),
    announced on stderr. Tensor-parallel ranks measure in lockstep and follow rank 0's verdicts."""
    sizes = curve_sizes(None, batch) if sizes is None else sizes
    curve = None
    for attempt in range(attempts):
        curve = leader_value(measure_cost_curve(model, sizes, batch=batch, repeats=5 + 4 * attempt))
        reason = implausible(curve)
        if reason is None:
            return curve
        say(quiet, f"lookahead: implausible cost measurement ({reason}; is the machine busy?)")
    say(quiet, "lookahead: using a conservative default cost curve; run `lookahead calibrate --refresh` on a "
                "quiet machine")
    return conservative_curve(curve.base_seconds, batch)


def _cached_problem(path) -> str | None:
    """Why a cached curve file cannot be used, or None."""
    try:
        curve = CostCurve.from_json(path.read_text())
    except (OSError, ValueError) as exc:
        return str(exc)
    return None if curve.source == "default" else implausible(curve)


def say(quiet: bool, message: str) -> None:
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
    cache = DynamicCache(config=model.config)
    make_compactable(cache, model.config, max_slots=0)  # as generation keeps it: sliding layers keep every slot
    _fill(model, cache, batch, prefix_len, vocab)
    for k in sizes:  # warm-up: first calls of a shape pay for kernel selection and allocation
        _time_rows(model, cache, prefix_len, k, vocab)
    times = {k: [] for k in sizes}
    for _ in range(repeats):  # interleave sizes so drifting machine load hits them alike
        for _ in range(WARM_FORWARDS):  # the pass starts after the last pass's largest forward
            _time_rows(model, cache, prefix_len, 1, vocab)
        for k in sizes:  # ascending: each size after a smaller one, as a generation's steps follow similar steps
            times[k].append(_time_rows(model, cache, prefix_len, k, vocab))
    seconds = [float(np.quantile(times[k], CURVE_QUANTILE)) for k in sizes]
    ratios = np.maximum.accumulate(np.array(seconds) / seconds[0])  # more rows never cost less
    return tuple(round(float(r), 4) for r in ratios), seconds[0]


def _fill(model, cache, batch: int, prefix_len: int, vocab: int) -> None:
    """Make `cache` hold `prefix_len` positions per sequence, as a prefill would, without paying for one (a
    1024-token prefill took 3 of the 9 s of a curve on the 2-core AVX2 machine): a one-token forward sets every
    layer up, random states of the layer's own scale append the rest (what a timed forward costs does not depend on
    the values it attends to)."""
    generator = torch.Generator().manual_seed(0)
    first = torch.randint(0, vocab, (batch, 1), generator=generator).to(model.device)
    model(first, **{CACHE_KWARG: cache}, use_cache=True, logits_to_keep=1)
    for index, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values
        more = [_like(states, prefix_len - 1, generator) for states in (keys, values)]
        cache.update(*more, index)


def _like(states: torch.Tensor, positions: int, generator: torch.Generator) -> torch.Tensor:
    """Random `[B, H, positions, D]` states of the scale of `states` (`[B, H, T, D]`), on its device and dtype."""
    shape = (*states.shape[:-2], positions, states.shape[-1])
    scale = states.float().abs().mean().clamp_min(1e-3)
    return (torch.randn(shape, generator=generator) * scale).to(device=states.device, dtype=states.dtype)


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
    model(ids, position_ids=positions, attention_mask=mask, **{CACHE_KWARG: cache}, use_cache=True)
    elapsed = time.perf_counter() - start
    cache.crop(-rows)
    return elapsed
