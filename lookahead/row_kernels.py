"""Which matmul computes a product of how many rows, measured per model and machine.

Three kernels can compute the packed linear layers' products (`packed_linear`): PyTorch's default matmul on the
model's own weights (MKL: quick for 1–3 rows on some Intel CPUs), the streamed kernel (`streamed_gemm`: the
weights streamed once for any row count) and oneDNN's prepacked product (what large products such as a prompt's
prefill use without the streamed kernel). Which is faster for k rows depends on the CPU, so it is measured: every
packed weight's product of k random rows on each kernel, kernels and row counts interleaved, a low quantile per
kernel. A row count whose first timed round already shows one kernel at most SETTLED_RATIO of the other's time is
not timed again (the default matmul on few rows took 5x the streamed kernel's time on the AVX2 machine: timing it
again only spent the first run's seconds).
The answer is two row counts and a kernel (`RowKernels`): up to `default_rows` rows the default matmul, up to
`streamed_rows` the streamed kernel, above that oneDNN — or, when the streamed kernel is used at all, the default
matmul, oneDNN on the layers' own weights or the streamed kernel itself, whichever a product of LARGE_PROBE rows
measured fastest (`large`; no copy of the weights in oneDNN's layout then; `packed_linear`). So where the streamed
kernel is available it is weighed against the default matmul, the kernel that computes what it declines, and
oneDNN is only timed for the largest products; when the streamed kernel wins at no row count the choice is
measured again between the default matmul and oneDNN. The choice is cached in memory and on disk beside the cost
curve, per model and machine (only the linear products are timed, so the attention and decoder-layer choices do
not matter).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from .calibration import CURVE_QUANTILE, digest, model_parts, say
from .distributed import is_leader, leader_value
from .packed_linear import LARGE_KERNELS
from .paths import cache_dir

MAX_DEFAULT_ROWS = 4  # the default matmul is tried for products of 1..this many rows
STREAMED_PROBES = (1, 2, 4, 8, 16, 24, 32, 48, 64)  # row counts the streamed kernel is timed at
KERNEL_MARGIN = 0.95  # a kernel is taken where it needs at most this share of the other kernel's time
MEASURE_BUDGET = 3.0  # seconds the timed rounds may take (at least 2 rounds)
# Part of the cache key: choices measured by an earlier rule are measured again (2: the streamed kernel is weighed
# against the default matmul, no longer against oneDNN; 3: the streamed kernel computes any row count in one pass
# over the weights, probed up to 64 rows; 4: the streamed kernel may stream weights in their exact block form;
# 5: several panels at once for few rows, AVX2 register tiles for 4-bit blocks;
# 6: products above the streamed kernel's rows weighed between the default matmul and unpacked oneDNN;
# 7: AVX-512 kernels with more panels a pass and float16 block records; 8: the streamed kernel may compute the
# large products too).
CHOICE_VERSION = 8
LARGE_PROBE = 128  # rows of the product (a short prompt's prefill) that decides the kernel above the streamed rows
LARGE_ROUNDS = 3  # timed rounds of that product on each kernel
SHAPED_FIRST_CALLS = ("packed", "onednn")  # kernels whose first call at each product shape pays for its setup
SETTLED_RATIO = 0.5  # after the first timed round, a row count where one kernel took at most this share of the
# other's time is decided: later rounds time only the row counts still in question


@dataclass(frozen=True)
class RowKernels:
    """Products of at most `default_rows` rows run PyTorch's default matmul, of at most `streamed_rows` rows the
    streamed kernel, larger ones oneDNN's prepacked product (when `streamed_rows` > 0: the kernel `large` names,
    the default matmul, oneDNN on the layers' own weights or the streamed kernel)."""

    default_rows: int = 0
    streamed_rows: int = 0
    large: str = "default"

    def describe(self, streamed: str = "the streamed kernel") -> str:
        """One line for the user: which kernel computes which row counts (`streamed` names the streamed kernel's
        part, e.g. with the AMX kernel computing its 4-bit layers)."""
        parts = []
        if self.default_rows:
            parts.append(f"up to {self.default_rows} rows on PyTorch's default matmul")
        if self.streamed_rows and self.large == "streamed":
            return ", ".join(parts + [f"{'more' if parts else 'all rows'} on {streamed}"])
        if self.streamed_rows > self.default_rows:
            first = self.default_rows + 1
            span = f"{first}–{self.streamed_rows}" if self.streamed_rows > first else f"{first}"
            parts.append(f"{span} rows on {streamed}")
        if not parts:
            return "all products on oneDNN's packed weights"
        larger = ({"default": "PyTorch's default matmul", "onednn": "oneDNN (unpacked)"}[self.large]
                  if self.streamed_rows else "oneDNN's packed weights")
        return ", ".join(parts) + f", more on {larger}"


def apply_row_kernels(model, kernels: RowKernels) -> None:
    """Set `kernels` on every packed linear layer of `model` (inside `packed_linear.packed_linears`). Raises
    `ValueError` for negative counts or streamed rows where the streamed kernel is not available."""
    from .packed_linear import set_default_rows, set_large_kernel, set_streamed_rows

    set_default_rows(model, kernels.default_rows)
    set_streamed_rows(model, kernels.streamed_rows)
    set_large_kernel(model, kernels.large)


def row_kernels_for(model, refresh: bool = False, quiet: bool = False) -> RowKernels:
    """The kernel choice for the model's packed linear layers on this machine: from memory or the disk cache,
    else measured (`measure_row_kernels`, ~8 s on the 2-core AVX2 machine, a notice on stderr) and cached.
    Tensor-parallel ranks take rank 0's answer."""
    from . import streamed_gemm

    key = digest(model_parts(model) + [f"row-kernels-{CHOICE_VERSION}", f"streamed={streamed_gemm.available()}",
                                      f"compact={getattr(model, '_lookahead_compact_weights', False)}"])
    path = cache_dir() / "cost" / f"{key}-row-kernels.json"
    found = _MEMORY.get(key) if not refresh else None
    if found is None and not refresh and path.exists():
        found = _read(path, streamed_gemm.available())
    if found is None:
        say(quiet or not is_leader(), "lookahead: measuring which matmul is fastest for a few rows")
        found = measure_row_kernels(model)
        if is_leader():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(asdict(found)))
    found = leader_value(found)
    _MEMORY[key] = found
    return found


_MEMORY: dict[str, RowKernels] = {}


def _read(path, streamed: bool) -> RowKernels | None:
    """The choice cached in `path`, or None when the file is unreadable, out of range, or names the streamed
    kernel where it is not available."""
    try:
        data = json.loads(path.read_text())
        found = RowKernels(data["default_rows"], data["streamed_rows"], data["large"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if found.large not in LARGE_KERNELS:
        return None
    counts_ok = all(isinstance(n, int) for n in (found.default_rows, found.streamed_rows))
    if not counts_ok or not 0 <= found.default_rows <= MAX_DEFAULT_ROWS:
        return None
    if not 0 <= found.streamed_rows <= (STREAMED_PROBES[-1] if streamed else 0):
        return None
    return found


@torch.no_grad()
def measure_row_kernels(model, repeats: int = 7, budget_seconds: float = MEASURE_BUDGET,
                        streamed: bool | None = None) -> RowKernels:
    """Time all of the model's packed products on each kernel. `default_rows` is the largest r <=
    MAX_DEFAULT_ROWS such that for every row count up to r the default matmul needs at most KERNEL_MARGIN of the
    time of the other kernel (the streamed one where it is available, else oneDNN). With the streamed kernel,
    `streamed_rows` is the largest probe row count above `default_rows` such that at it and every probe between
    them the default matmul needs more than KERNEL_MARGIN of the streamed kernel's time (it does not clearly
    win); when there is none, the choice is measured again without the streamed kernel. Up to `repeats` timed
    rounds after a warm-up: fewer (at least 2) when the first shows that `repeats` would take longer than
    `budget_seconds` (a large model streams gigabytes per round). `streamed=False` leaves the streamed kernel out
    (None: in when available)."""
    from . import streamed_gemm
    from .packed_linear import packed_weights

    weights = packed_weights(model)
    if not weights:
        return RowKernels()
    streamed = streamed_gemm.available() if streamed is None else streamed and streamed_gemm.available()
    low = _low_times(weights, _plan(streamed), repeats, budget_seconds, least=2)
    if not streamed:
        return RowKernels(_default_rows(low, "packed"), 0)
    chosen = _choose_streamed(low)
    if not chosen.streamed_rows:
        return measure_row_kernels(model, repeats, budget_seconds, streamed=False)
    return replace(chosen, large=_choose_large(weights, budget_seconds, _tiled(weights)))


def _tiled(weights) -> bool:
    """Whether every packed weight's streamed panels are held for the AMX kernels (`streamed_gemm.AMX_KINDS`)."""
    from . import streamed_gemm

    return all(packed.streamed().kind in streamed_gemm.AMX_KINDS for packed in weights)


def _choose_large(weights, budget_seconds: float, tiles: bool = False) -> str:
    """The fastest of oneDNN's product on the layers' own weights ("onednn") and, with `tiles`, the streamed kernel
    ("streamed") when it needs at most KERNEL_MARGIN of the default matmul's time for LARGE_PROBE rows of every
    weight (low quantile of up to LARGE_ROUNDS rounds after a warm-up: as many as fit `budget_seconds`, at least
    one), else "default". `tiles`: every weight is held for the AMX kernels, which compute 16 rows a pass over the
    weights for little more than one; the other streamed kernels take a few rows a pass, so a prefill would stream
    the weights many times over and is not worth timing (a large model's first measurement would take minutes)."""
    candidates = ("onednn", "streamed") if tiles else ("onednn",)
    low = _low_times(weights, [(LARGE_PROBE, name) for name in ("default", *candidates)], LARGE_ROUNDS,
                     budget_seconds, least=1)
    best = min(candidates, key=lambda name: low[LARGE_PROBE, name])
    return best if low[LARGE_PROBE, best] <= KERNEL_MARGIN * low[LARGE_PROBE, "default"] else "default"


def _low_times(weights, plan: list[tuple[int, str]], repeats: int, budget_seconds: float,
               least: int) -> dict[tuple[int, str], float]:
    """The low-quantile seconds of each (rows, kernel) of `plan` over timed rounds after a warm-up (`_warm_up`):
    `repeats` rounds, fewer (at least `least`) when the first timed one shows that they would take longer than
    `budget_seconds`; the rounds after the first time only the row counts it left unsettled (`_unsettled`)."""
    times = {entry: [] for entry in plan}
    _warm_up(weights, plan)
    _time_round(weights, plan, times)
    rest = _unsettled(plan, times)
    if rest:
        seconds = sum(times[entry][0] for entry in rest)
        rounds = max(least, min(repeats, int(budget_seconds / max(seconds, 1e-9))))
        for _ in range(rounds - 1):
            _time_round(weights, rest, times)
    return {entry: float(np.quantile(seconds, CURVE_QUANTILE)) for entry, seconds in times.items()}


def _warm_up(weights, plan: list[tuple[int, str]]) -> None:
    """Untimed first calls: each kernel of `plan` once on every weight, which builds the layouts and loads the
    kernels — at every planned row count for oneDNN's (SHAPED_FIRST_CALLS: it makes a primitive per product shape),
    at the fewest rows for the others (their first call at a new row count measured no slower than later ones)."""
    fewest = {}
    for rows, name in plan:
        fewest[name] = min(rows, fewest.get(name, rows))
    first_calls = [(rows, name) for rows, name in plan if name in SHAPED_FIRST_CALLS or rows == fewest[name]]
    _time_round(weights, first_calls, {entry: [] for entry in first_calls})


def _unsettled(plan: list[tuple[int, str]], times: dict) -> list[tuple[int, str]]:
    """The entries of `plan` whose row count the timed rounds so far leave in question: the fastest kernel's time
    there more than SETTLED_RATIO of the next fastest's (a row count timed on one kernel only is never in
    question)."""
    by_rows = {}
    for rows, name in plan:
        by_rows.setdefault(rows, []).append(min(times[rows, name]))
    fastest = {rows: sorted(seconds)[:2] for rows, seconds in by_rows.items()}
    open_rows = {rows for rows, two in fastest.items() if len(two) > 1 and two[0] > SETTLED_RATIO * two[1]}
    return [entry for entry in plan if entry[0] in open_rows]


def _plan(streamed: bool) -> list[tuple[int, str]]:
    """(row count, kernel) pairs to time: with the streamed kernel, it and the default matmul at 1..MAX_DEFAULT_ROWS
    rows and at every probe; without it, the default matmul and oneDNN at 1..MAX_DEFAULT_ROWS rows."""
    rows = sorted(set(range(1, MAX_DEFAULT_ROWS + 1)) | (set(STREAMED_PROBES) if streamed else set()))
    return [(r, name) for name in ("default", "streamed" if streamed else "packed") for r in rows]


def _default_rows(low: dict[tuple[int, str], float], other: str) -> int:
    """The largest r <= MAX_DEFAULT_ROWS such that at every row count up to r the default matmul needs at most
    KERNEL_MARGIN of kernel `other`'s low-quantile time."""
    rows = 0
    while rows < MAX_DEFAULT_ROWS and low[rows + 1, "default"] <= KERNEL_MARGIN * low[rows + 1, other]:
        rows += 1
    return rows


def _choose_streamed(low: dict[tuple[int, str], float]) -> RowKernels:
    """The `RowKernels` the low-quantile seconds of the default matmul and the streamed kernel imply (see
    `measure_row_kernels`); streamed rows 0 when the streamed kernel does not hold at the first probe above the
    default matmul's rows."""
    default_rows, streamed_rows = _default_rows(low, "streamed"), 0
    for rows in (r for r in STREAMED_PROBES if r > default_rows):
        if low[rows, "default"] <= KERNEL_MARGIN * low[rows, "streamed"]:
            break
        streamed_rows = rows
    return RowKernels(default_rows, streamed_rows)


def _time_round(weights, plan: list[tuple[int, str]], times: dict) -> None:
    """One round: for each row count of `plan`, every packed weight's product of that many random rows on each
    planned kernel; appends the seconds of each (rows, kernel) pass to `times`."""
    from . import packed_linear

    kernels = {"default": packed_linear.default_product, "packed": packed_linear.packed_product,
               "streamed": packed_linear.streamed_product, "onednn": packed_linear.onednn_product}
    for rows in sorted({r for r, _ in plan}):
        inputs = [torch.randn(rows, w.linears[0].in_features, dtype=torch.float32) for w in weights]
        for name in [n for r, n in plan if r == rows]:
            start = time.perf_counter()
            for x, packed in zip(inputs, weights):
                kernels[name](x, packed)
            times[rows, name].append(time.perf_counter() - start)
