"""PNG plots of a `bench_generate.py` result: speedup per category, lookahead's tokens-per-step histogram, the
planner's calibration (predicted vs committed tokens per step), the drafter ablation and the cost curve.

    python benchmarks/plots.py benchmarks/results/NAME.json     # (re)draw the plots next to the JSON

`bench_generate.py --plots` calls `save_plots` right after a run.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

# Issue 5's speedup targets over HF greedy (default model, fp32, CPU), drawn as markers on the speedup plot.
TARGETS = {"code": 2.0, "summarization": 3.5, "rag": 3.5, "chat": 1.6}
REFERENCE = "hf_greedy"
HISTOGRAM_METHOD = "lookahead"
SAMPLED_PAIRS = {"lookahead_sample": "hf_sample"}  # sampled methods: speedup over their own baseline
ABLATION_PREFIX = "lookahead_"
ABLATION_VARIANTS = ("prompt", "pool", "window", "recycle")


def save_plots(result: dict, json_path: Path) -> list[Path]:
    """Draw the plots of `result` (a `bench_generate` result dict) as PNGs next to `json_path`.

    Returns the written paths: `<stem>-speedup.png`; when lookahead ran `<stem>-tokens-per-step.png` and, if
    its planner made predictions, `<stem>-calibration.png`; `<stem>-ablation.png` when ablation variants ran;
    `<stem>-cost-curve.png` when the result holds the model's cost curve.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    json_path = Path(json_path)
    methods = result["settings"]["methods"]
    paths = [json_path.with_name(f"{json_path.stem}-speedup.png")]
    plot_speedup(result, paths[0])
    if HISTOGRAM_METHOD in methods:
        paths.append(json_path.with_name(f"{json_path.stem}-tokens-per-step.png"))
        plot_tokens_per_step(result, paths[-1])
        if calibration_pairs(result, HISTOGRAM_METHOD):
            paths.append(json_path.with_name(f"{json_path.stem}-calibration.png"))
            plot_calibration(result, paths[-1])
    if any(ABLATION_PREFIX + v in methods for v in ABLATION_VARIANTS):
        paths.append(json_path.with_name(f"{json_path.stem}-ablation.png"))
        plot_ablation(result, paths[-1])
    if result.get("cost_curve"):
        paths.append(json_path.with_name(f"{json_path.stem}-cost-curve.png"))
        plot_cost_curve(result["cost_curve"], paths[-1])
    return paths


def plot_cost_curve(curve: dict, path: Path, rates=(0.5, 0.7, 0.9), chain: int = 8) -> None:
    """The measured cost curve t(k)/t(1) with, for a few acceptance rates of an `chain`-token draft chain, the
    number of rows the budget verifies marked on it. `curve` is `CostCurve` as a dict."""
    import matplotlib.pyplot as plt
    import numpy as np

    from lookahead.budget import best_row_count
    from lookahead.cost_curve import CostCurve

    cost = CostCurve(tuple(curve["sizes"]), tuple(curve["ratios"]), curve["base_seconds"], curve["prefix_len"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(cost.sizes, cost.ratios, "o-", label="measured t(k)/t(1)")
    ax.plot(cost.sizes, cost.sizes, ":", color="grey", label="linear (no batching benefit)")
    for rate in rates:
        k, _ = best_row_count(rate ** np.arange(1, chain + 1), 0, 0.0, cost)
        ax.plot([1 + k], [cost.ratio(1 + k)], "s", markersize=9, label=f"chosen at acceptance {rate}: {1 + k} rows")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, max(cost.ratios) * 1.3)
    ax.set_xlabel("rows verified in one forward (k)")
    ax.set_ylabel("cost relative to one row")
    ax.set_title(f"verification cost curve (one row = {cost.base_seconds * 1000:.0f} ms)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_speedup(result: dict, path: Path) -> None:
    """Grouped bars: median-based speedup over HF greedy per category for every other greedy method (sampled
    methods: over their own sampling baseline), with the min-based speedup as a dot, a line at 1x and issue 5's
    targets as dashes."""
    import matplotlib.pyplot as plt

    summary = result["summary"]
    groups = list(summary)
    methods = [m for m in result["settings"]["methods"] if m != REFERENCE and m not in SAMPLED_PAIRS.values()]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.4 + 0.35 * len(groups) * max(len(methods), 3)), 4.2))
    width = 0.8 / max(len(methods), 1)
    for k, method in enumerate(methods):
        baseline = SAMPLED_PAIRS.get(method, REFERENCE)
        xs = [g + (k - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        medians = [summary[group][method].get(f"speedup_vs_{baseline}", 0.0) for group in groups]
        minima = [summary[group][method].get(f"speedup_vs_{baseline}_min", 0.0) for group in groups]
        label = method if baseline == REFERENCE else f"{method} (× {baseline})"
        bars = ax.bar(xs, medians, width, label=label)
        ax.plot(xs, minima, "o", color="black", markersize=3)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    for g, group in enumerate(groups):
        if group in TARGETS:
            ax.hlines(TARGETS[group], g - 0.45, g + 0.45, colors="black", linestyles="dashed", linewidth=1)
    _finish_bars(fig, ax, groups, "speedup over HF greedy (×)",
                 _title(result, "speedup per category (bars: median, dots: min, dashes: target)"), path)


def plot_tokens_per_step(result: dict, path: Path) -> None:
    """Fraction of lookahead decoding steps that committed k tokens, one bar series per category."""
    import matplotlib.pyplot as plt

    counts = tokens_per_step_counts(result, HISTOGRAM_METHOD)
    groups = list(counts)
    top = max((k for counter in counts.values() for k in counter), default=1)
    fig, ax = plt.subplots(figsize=(max(6.5, 0.45 * top * len(groups) ** 0.5), 4.2))
    width = 0.8 / max(len(groups), 1)
    for j, group in enumerate(groups):
        total = sum(counts[group].values()) or 1
        ks = range(1, top + 1)
        xs = [k + (j - (len(groups) - 1) / 2) * width for k in ks]
        ax.bar(xs, [counts[group][k] / total for k in ks], width, label=f"{group} ({total} steps)")
    ax.set_xticks(range(1, top + 1))
    ax.set_xlabel("tokens committed in one step")
    ax.set_ylabel("fraction of steps")
    ax.set_title(_title(result, f"{HISTOGRAM_METHOD}: tokens per step"), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def calibration_pairs(result: dict, method: str) -> dict[str, list[tuple[float, int]]]:
    """Per category (in run order), the (predicted, committed) tokens of every step of `method`'s runs."""
    pairs: dict[str, list[tuple[float, int]]] = {}
    for run in result["runs"]:
        if run["method"] == method and run["stats"] is not None and run["stats"].get("calibration"):
            pairs.setdefault(run["category"], []).extend(map(tuple, run["stats"]["calibration"]))
    return pairs


def plot_calibration(result: dict, path: Path, width: float = 0.25) -> None:
    """The planner's calibration: steps binned by predicted tokens (bins of `width`), mean committed tokens per
    bin (marker area ~ steps in the bin), each category's mean predicted vs mean committed (labelled squares)
    and the diagonal a calibrated planner follows."""
    import matplotlib.pyplot as plt
    import numpy as np

    pairs = calibration_pairs(result, HISTOGRAM_METHOD)
    every = np.array([p for group in pairs.values() for p in group], dtype=float)  # [steps, 2]
    fig, ax = plt.subplots(figsize=(6, 5))
    bins = np.floor(every[:, 0] / width).astype(int)
    for b in np.unique(bins):
        members = every[bins == b]
        ax.scatter(members[:, 0].mean(), members[:, 1].mean(), s=8 + 2 * len(members) ** 0.8, color="tab:blue",
                   alpha=0.6)
    for group, group_pairs in pairs.items():
        arr = np.array(group_pairs, dtype=float)
        ax.plot(arr[:, 0].mean(), arr[:, 1].mean(), "s", markersize=7, label=f"{group}: {arr[:, 0].mean():.2f} "
                f"predicted, {arr[:, 1].mean():.2f} committed ({len(arr)} steps)")
    top = max(every.max(), 2.0)
    ax.plot([1, top], [1, top], ":", color="grey", label="calibrated")
    ax.set_xlabel("predicted tokens in the step (planner)")
    ax.set_ylabel("committed tokens in the step (mean)")
    ax.set_title(_title(result, f"{HISTOGRAM_METHOD}: planner calibration (dots: steps binned by prediction)"),
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ablation(result: dict, path: Path) -> None:
    """Each model-free drafter alone and all together: tokens per step per category (bars), with the speedup
    over HF greedy written on each bar."""
    import matplotlib.pyplot as plt

    summary = result["summary"]
    groups = list(summary)
    ran = result["settings"]["methods"]
    methods = [ABLATION_PREFIX + v for v in ABLATION_VARIANTS if ABLATION_PREFIX + v in ran]
    methods += [HISTOGRAM_METHOD] if HISTOGRAM_METHOD in ran else []
    fig, ax = plt.subplots(figsize=(max(6.5, 1.4 + 0.35 * len(groups) * len(methods)), 4.2))
    width = 0.8 / max(len(methods), 1)
    for k, method in enumerate(methods):
        xs = [g + (k - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        entries = [summary[group][method] for group in groups]
        label = "all" if method == HISTOGRAM_METHOD else method.removeprefix(ABLATION_PREFIX)
        bars = ax.bar(xs, [e["tokens_per_step"] for e in entries], width, label=label)
        ax.bar_label(bars, labels=[f"{e.get('speedup_vs_' + REFERENCE, 0):.2f}x" for e in entries], fontsize=6,
                     padding=2, rotation=90)
    _finish_bars(fig, ax, groups, "tokens per step (bar labels: × HF greedy)",
                 _title(result, "ablation: each drafter alone and all together"), path)


def tokens_per_step_counts(result: dict, method: str) -> dict[str, Counter]:
    """Per category (in run order), a Counter {tokens committed in a step: steps}, from the runs' stats.

    JSON turns the Counter's int keys into strings; both forms are accepted.
    """
    counts: dict[str, Counter] = {}
    for run in result["runs"]:
        if run["method"] == method and run["stats"] is not None:
            counter = counts.setdefault(run["category"], Counter())
            counter.update({int(k): v for k, v in run["stats"]["tokens_per_step"].items()})
    return counts


def _title(result: dict, what: str) -> str:
    """Plot title: what it shows, then the model and run size."""
    settings = result["settings"]
    return (f"{what}\n{result['model']}, {settings['dtype']}, max {settings['max_new_tokens']} new tokens, "
            f"repetitions: {settings['repeats']}")


def main(argv: list[str] | None = None) -> None:
    """Redraw the plots of a saved result JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="a JSON written by bench_generate.py")
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text(encoding="utf-8"))
    for path in save_plots(result, args.result):
        print(path)


if __name__ == "__main__":
    main()


def _finish_bars(fig, ax, groups: list[str], ylabel: str, title: str, path) -> None:
    """Common end of a per-category bar chart: the 1.0 line, category ticks, labels, legend; save and close."""
    import matplotlib.pyplot as plt

    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
