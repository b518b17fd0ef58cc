"""PNG plots of a `bench_generate.py` result: speedup per category, and lookahead's tokens-per-step histogram.

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


def save_plots(result: dict, json_path: Path) -> list[Path]:
    """Draw the plots of `result` (a `bench_generate` result dict) as PNGs next to `json_path`.

    Returns the written paths: `<stem>-speedup.png`, `<stem>-tokens-per-step.png` when lookahead ran and
    `<stem>-cost-curve.png` when the result holds the model's cost curve.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    json_path = Path(json_path)
    paths = [json_path.with_name(f"{json_path.stem}-speedup.png")]
    plot_speedup(result, paths[0])
    if HISTOGRAM_METHOD in result["settings"]["methods"]:
        paths.append(json_path.with_name(f"{json_path.stem}-tokens-per-step.png"))
        plot_tokens_per_step(result, paths[-1])
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
    """Grouped bars: median-based speedup over HF greedy per category for every other method, with the
    min-based speedup as a dot, a line at 1x and issue 5's targets as dashes."""
    import matplotlib.pyplot as plt

    summary = result["summary"]
    groups = list(summary)
    methods = [m for m in result["settings"]["methods"] if m != REFERENCE]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.4 + 1.3 * len(groups)), 4.2))
    width = 0.8 / max(len(methods), 1)
    for k, method in enumerate(methods):
        xs = [g + (k - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        medians = [summary[group][method].get(f"speedup_vs_{REFERENCE}", 0.0) for group in groups]
        minima = [summary[group][method].get(f"speedup_vs_{REFERENCE}_min", 0.0) for group in groups]
        bars = ax.bar(xs, medians, width, label=method)
        ax.plot(xs, minima, "o", color="black", markersize=3)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    for g, group in enumerate(groups):
        if group in TARGETS:
            ax.hlines(TARGETS[group], g - 0.45, g + 0.45, colors="black", linestyles="dashed", linewidth=1)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("speedup over HF greedy (×)")
    ax.set_title(_title(result, "speedup per category (bars: median, dots: min, dashes: target)"), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
