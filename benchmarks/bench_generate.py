"""Speed suite: HF greedy, HF prompt lookup, HF assisted generation and lookahead (model-free, its own loop with
speculation off, each model-free drafter alone, with the draft model when one is given, and sampled) on the same
prompts.

    python benchmarks/bench_generate.py [--model PATH] [--categories code rag ...] [--prompts-per-category 4]
        [--max-new-tokens 128] [--repeats 2] [--threads 2] [--methods hf_greedy lookahead ...]
        [--ablation] [--sample] [--config window_levels=3 ...] [--draft-model PATH | --draft-layers N]
        [--warm-recycle] [--out benchmarks/results/NAME.json] [--plots]

All methods run in one process on the same encoded prompts, greedy (`do_sample=False`) except the sampled pair
(`hf_sample`, `lookahead_sample`: T=0.7, top_p=0.95, lookahead seeded). After one untimed warm-up run per
method, every repetition visits every prompt and runs all methods on it in an order rotated from prompt to
prompt, so slow phases of a noisy machine hit every method alike. Each run records its time, new tokens, target
forwards (counted with a forward pre-hook, the same way for every method) and, for greedy methods, whether its
output is token-identical to HF greedy on the same prompt and repetition. Per category the summary gives, for
each method, the sum over prompts of the median (and of the min) time over repetitions, the speedups over each
baseline that ran (ratios of tokens per second: of times when the outputs are identical), tokens per step,
tokens/s, the planner's predicted tokens per step and the identical-output rate. The markdown tables printed at
the end are ready for the README; the JSON holds every run, the summary, the settings, the machine and the
command line.

Token recycling keeps its table across the calls of one `Lookahead` object. So that a repetition never drafts
from its own earlier output, each run starts from the table as it stood before that prompt's first run (warm
from the earlier prompts only); `--warm-recycle` keeps the table as it is instead.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from prompts import CATEGORIES, DEFAULT_CATEGORIES, DEFAULT_PROMPTS_DIR, Prompt, encode, load_prompts

# Each model-free drafter alone (`--ablation`), as overrides of the `lookahead` config. The window's n-grams reach
# the tree through the pool, so the window runs with a pool fed by the window only.
ABLATION = {
    "lookahead_prompt": dict(window_levels=0, pool_candidates=0, recycle_nodes=0),
    "lookahead_pool": dict(window_levels=0, prompt_candidates=0, recycle_nodes=0),
    "lookahead_window": dict(pool_from_text=False, prompt_candidates=0, recycle_nodes=0),
    "lookahead_recycle": dict(window_levels=0, pool_candidates=0, prompt_candidates=0),
}
SAMPLED_METHODS = ("hf_sample", "lookahead_sample")  # `--sample`
SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.95)
SAMPLE_SEED = 1234  # lookahead_sample's Gumbel seed
METHODS = ("hf_greedy", "hf_prompt_lookup", "hf_assisted", "lookahead", "lookahead_draft", "lookahead_off",
           *ABLATION, *SAMPLED_METHODS)
DEFAULT_METHODS = ("hf_greedy", "hf_prompt_lookup", "lookahead", "lookahead_off")
DRAFT_METHODS = ("hf_assisted", "lookahead_draft")  # need a draft model; added to the defaults when one is given
REFERENCE = "hf_greedy"  # outputs of every other greedy method are compared with it, token for token
# Speedups are reported against each baseline that ran: sampled methods against HF sampling only, greedy ones
# against the others.
BASELINES = ("hf_greedy", "hf_prompt_lookup", "lookahead_off")
SAMPLED_BASELINES = ("hf_sample",)
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def run_suite(model, tokenizer, prompts: list[Prompt], methods, repeats: int, max_new_tokens: int,
              config, *, prompt_lookup_tokens: int = 10, draft_model=None, progress: bool = True,
              warm_recycle: bool = False) -> dict:
    """Run every method on every prompt `repeats` times (interleaved) and summarize.

    `config` is the `LookaheadConfig` of the `lookahead` method (`lookahead_off` always uses
    `LookaheadConfig.off()`, `lookahead_draft` adds `draft_model`, the ablation methods override it with
    `ABLATION`, `lookahead_sample` adds a seed); `hf_assisted` and `lookahead_draft` need `draft_model`.
    `warm_recycle`: keep each `Lookahead`'s recycling table across runs as it is (default: every run of a prompt
    starts from the table as it stood before that prompt's first run). Returns a JSON-ready dict with
    `settings`, `prompts` (id, category, prompt tokens), `runs` (one dict per timed run, see `_timed_run`) and
    `summary` (see `summarize`). Raises `ValueError` for an unknown method, a missing draft model or bad counts.
    """
    _check_suite_args(methods, repeats, max_new_tokens, prompts, draft_model)
    kwargs = method_kwargs(methods, config, prompt_lookup_tokens, draft_model)
    tables = RecycleTables(kwargs, enabled=not warm_recycle)
    encoded = [encode(tokenizer, prompt).to(model.device) for prompt in prompts]  # [1, L] each
    bar = _progress_bar(len(methods) * (1 + repeats * len(prompts)), progress)
    with ForwardCounter(model) as counter:
        for method in methods:  # warm-up: JIT compiles, allocator and kernel caches; not recorded
            bar.set_postfix_str(f"warm-up {method}")
            _timed_run(model, encoded[0], method, kwargs[method], max_new_tokens, counter)
            bar.update()
        tables.clear()  # the warm-up prompt is a suite prompt too

        def run_one(input_ids, method, prompt_id):
            tables.before_run(method, prompt_id)
            return _timed_run(model, input_ids, method, kwargs[method], max_new_tokens, counter)

        runs = interleaved_runs(prompts, encoded, list(methods), repeats, bar, run_one)
    bar.close()
    return {
        "settings": {"methods": list(methods), "repeats": repeats, "max_new_tokens": max_new_tokens,
                     "prompt_lookup_tokens": prompt_lookup_tokens, "lookahead_config": config.as_dict(),
                     "ablation": {m: ABLATION[m] for m in methods if m in ABLATION},
                     "sampling": {**SAMPLING, "lookahead_seed": SAMPLE_SEED} if set(methods) & set(SAMPLED_METHODS)
                     else None, "warm_recycle": warm_recycle,
                     "dtype": str(model.dtype).removeprefix("torch.")},
        "prompts": [{"id": p.id, "category": p.category, "chat": p.chat, "prompt_tokens": int(ids.shape[1])}
                    for p, ids in zip(prompts, encoded)],
        "runs": runs,
        "summary": summarize(runs, methods),
    }


def interleaved_runs(prompts: list[Prompt], encoded: list, methods: list[str], repeats: int, bar,
                     run_one) -> list[dict]:
    """`repeats` rounds over the prompts; on each prompt every method runs once, in an order rotated from prompt
    to prompt. run_one(input_ids, method, prompt_id) -> run dict; each run gets prompt_id, category, repeat, slot
    and the identity marks of `mark_identity`. `bar` is advanced once per run."""
    runs: list[dict] = []
    for repeat in range(repeats):
        for index, (prompt, input_ids) in enumerate(zip(prompts, encoded)):
            round_runs = []
            for slot, method in enumerate(rotated(methods, repeat * len(prompts) + index)):
                bar.set_postfix_str(f"{prompt.category} {method}")
                round_runs.append(dict(prompt_id=prompt.id, category=prompt.category, repeat=repeat, slot=slot,
                                       **run_one(input_ids, method, prompt.id)))
                bar.update()
            mark_identity(round_runs)
            runs += round_runs
    return runs


def method_kwargs(methods, config, prompt_lookup_tokens: int, draft_model) -> dict[str, dict]:
    """The extra `generate` keyword arguments of each method (one `Lookahead` object per lookahead method)."""
    from lookahead import Lookahead, LookaheadConfig

    table = {
        "hf_greedy": lambda: {},
        "hf_prompt_lookup": lambda: {"prompt_lookup_num_tokens": prompt_lookup_tokens},
        "hf_assisted": lambda: {"assistant_model": draft_model},
        "lookahead": lambda: {"custom_generate": Lookahead(config)},
        "lookahead_draft": lambda: {"custom_generate": Lookahead(config, draft_model=draft_model)},
        "lookahead_off": lambda: {"custom_generate": Lookahead(LookaheadConfig.off())},
        "hf_sample": lambda: dict(SAMPLING),
        "lookahead_sample": lambda: {"custom_generate": Lookahead(config.with_overrides(seed=SAMPLE_SEED)),
                                     **SAMPLING},
    }
    for name, overrides in ABLATION.items():
        window = {"window_levels": config.window_levels or 2} if name == "lookahead_window" else {}
        table[name] = lambda o=overrides, w=window: {"custom_generate": Lookahead(config.with_overrides(**o, **w))}
    return {method: table[method]() for method in methods}


class RecycleTables:
    """Keeps each run of a prompt from drafting with recycled predictions of that prompt's earlier runs.

    Each `Lookahead` object of `kwargs` that owns a recycling table (`recycle_table`) gets, before a run, the
    table as it stood before the first run of that prompt (taken then); disabled, it does nothing.
    """

    def __init__(self, kwargs: dict[str, dict], enabled: bool):
        self.tables = {}
        for method, extra in kwargs.items():
            table = getattr(extra.get("custom_generate"), "recycle_table", None)
            if enabled and table is not None:
                self.tables[method] = table
        self.saved: dict[tuple[str, str], object] = {}

    def clear(self) -> None:
        """Empty every table (after the warm-up)."""
        for table in self.tables.values():
            table.clear()

    def before_run(self, method: str, prompt_id: str) -> None:
        """Restore (or, on the prompt's first run, save) the table of `method` for `prompt_id`."""
        table = self.tables.get(method)
        if table is None:
            return
        key = (method, prompt_id)
        if key in self.saved:
            table.restore(self.saved[key])
        else:
            self.saved[key] = table.snapshot()


class ForwardCounter:
    """Counts calls of `model.forward` (target forwards) while active; a context manager."""

    def __init__(self, model):
        self.model, self.count, self._handle = model, 0, None

    def __enter__(self) -> "ForwardCounter":
        self._handle = self.model.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    def _hook(self, module, args) -> None:
        self.count += 1


def _timed_run(model, input_ids: torch.Tensor, method: str, kwargs: dict, max_new_tokens: int,
               counter: ForwardCounter) -> dict:
    """Generate once (greedy unless `kwargs` sample) and measure it.

    Returns `method`, `seconds`, `prompt_tokens`, `new_tokens`, `tokens_per_second`, `forwards` (target forwards,
    prefill included), `tokens_per_step` (new tokens after the first, per target forward after the first),
    `tokens` (the new token ids) and `stats` (`DecodeStats.as_dict()` for lookahead methods, else None).
    """
    counter.count = 0
    start = time.perf_counter()
    kwargs = {"do_sample": False, **kwargs}
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                            **kwargs)  # [1, L + new]
    seconds = time.perf_counter() - start
    tokens = output[0, input_ids.shape[1]:].tolist()
    decoder = kwargs.get("custom_generate")
    steps = counter.count - 1
    return {
        "method": method, "seconds": seconds, "prompt_tokens": int(input_ids.shape[1]), "new_tokens": len(tokens),
        "tokens_per_second": len(tokens) / seconds, "forwards": counter.count,
        "tokens_per_step": (len(tokens) - 1) / steps if steps > 0 else 1.0,
        "tokens": tokens, "stats": decoder.last_stats.as_dict() if decoder is not None else None,
        "sampled": bool(kwargs["do_sample"]),
    }


def rotated(methods, shift: int) -> list[str]:
    """`methods` rotated left by `shift` (mod its length): the run order for one prompt."""
    methods = list(methods)
    shift %= len(methods)
    return methods[shift:] + methods[:shift]


def mark_identity(round_runs: list[dict]) -> None:
    """Set `identical` and `first_divergence` on each run of one prompt and repetition, vs `REFERENCE`.

    Both stay None for the reference itself, for sampled runs and when the reference did not run;
    `first_divergence` is the index of the first differing new token (or the shorter length when one output is
    a prefix of the other).
    """
    reference = next((run["tokens"] for run in round_runs if run["method"] == REFERENCE), None)
    for run in round_runs:
        run["identical"] = run["first_divergence"] = None
        if reference is None or run["method"] == REFERENCE or run.get("sampled"):
            continue
        run["identical"] = run["tokens"] == reference
        if not run["identical"]:
            pairs = zip(run["tokens"], reference)
            run["first_divergence"] = next((i for i, (a, b) in enumerate(pairs) if a != b),
                                           min(len(run["tokens"]), len(reference)))


def summarize(runs: list[dict], methods) -> dict:
    """Per group (each category, then "all") and method: times, rates and speedups (see `_method_summary`).

    Speedups (`speedup_vs_<baseline>`, see `_add_speedups`) are against every baseline of BASELINES that ran for
    greedy methods, and of SAMPLED_BASELINES for sampled ones."""
    groups = list(dict.fromkeys(run["category"] for run in runs))  # in run (= prompt) order
    summary = {}
    for group in [*groups, "all"]:
        members = [run for run in runs if group in ("all", run["category"])]
        by_method = {m: [run for run in members if run["method"] == m] for m in methods}
        per_method = {m: _method_summary(rs) for m, rs in by_method.items()}
        for method, entry in per_method.items():
            sampled = any(run.get("sampled") for run in by_method[method])
            for baseline in SAMPLED_BASELINES if sampled else BASELINES:
                if baseline in per_method and entry["runs"] and per_method[baseline]["runs"]:
                    _add_speedups(entry, per_method[baseline], baseline, by_method[method], by_method[baseline])
        summary[group] = per_method
    return summary


def _prompt_times(runs: list[dict], reduce) -> dict[str, float]:
    """Per prompt id, `reduce` (median or min) of the run times."""
    by_prompt: dict[str, list[float]] = {}
    for run in runs:
        by_prompt.setdefault(run["prompt_id"], []).append(run["seconds"])
    return {pid: reduce(seconds) for pid, seconds in by_prompt.items()}


def _prompt_rates(runs: list[dict]) -> dict[str, float]:
    """Per prompt id, median new tokens / median time (tokens per second)."""
    times, tokens = _prompt_times(runs, statistics.median), {}
    for run in runs:
        tokens.setdefault(run["prompt_id"], []).append(run["new_tokens"])
    return {pid: statistics.median(tokens[pid]) / t for pid, t in times.items()}


def _method_summary(runs: list[dict]) -> dict:
    """Aggregate the runs of one method over a group of prompts.

    `time_median_s` / `time_min_s` are sums over prompts of the per-prompt median / min over repetitions;
    `tokens_per_second` divides the summed per-prompt median new tokens by `time_median_s`; `tokens_per_step`
    is tokens committed per target forward after the prefill, pooled over all runs; `identical_rate` is None
    when no run was checked. Lookahead methods add `rows_per_step` (rows verified per decoding step) and
    `expected_tokens_per_step` (the planner's mean prediction over the steps it predicted), pooled.
    """
    new_tokens: dict[str, list[int]] = {}
    for run in runs:
        new_tokens.setdefault(run["prompt_id"], []).append(run["new_tokens"])
    tokens = sum(statistics.median(counts) for counts in new_tokens.values())
    time_median = sum(_prompt_times(runs, statistics.median).values())
    time_min = sum(_prompt_times(runs, min).values())
    steps = sum(run["forwards"] - 1 for run in runs)
    checked = [run["identical"] for run in runs if run["identical"] is not None]
    stats = [run["stats"] for run in runs if run.get("stats")]
    predictions = [pair[0] for s in stats for pair in s.get("calibration", [])]
    return {
        "prompts": len(new_tokens), "runs": len(runs),
        "time_median_s": time_median, "time_min_s": time_min, "new_tokens": tokens,
        "tokens_per_second": tokens / time_median if time_median else 0.0,
        "tokens_per_second_best": tokens / time_min if time_min else 0.0,
        "tokens_per_step": sum(run["new_tokens"] - 1 for run in runs) / steps if steps > 0 else 1.0,
        "rows_per_step": sum(s["rows_verified"] for s in stats) / max(1, sum(s["steps"] for s in stats))
        if stats else None,
        "expected_tokens_per_step": sum(predictions) / len(predictions) if predictions else None,
        "identical_runs": sum(checked), "checked_runs": len(checked),
        "identical_rate": sum(checked) / len(checked) if checked else None,
    }


def _add_speedups(entry: dict, base: dict, baseline: str, runs: list[dict], base_runs: list[dict]) -> None:
    """Add `speedup_vs_<baseline>` (ratio of the median-based tokens/s), `..._min` (of the min-based ones) and
    `speedup_per_prompt_vs_<baseline>` (per prompt, ratio of median tokens / median time) to `entry`. With
    identical outputs these are ratios of times; sampled outputs differ in length, so rates are compared."""
    entry[f"speedup_vs_{baseline}"] = entry["tokens_per_second"] / base["tokens_per_second"]
    entry[f"speedup_vs_{baseline}_min"] = entry["tokens_per_second_best"] / base["tokens_per_second_best"]
    rates, base_rates = _prompt_rates(runs), _prompt_rates(base_runs)
    entry[f"speedup_per_prompt_vs_{baseline}"] = {pid: r / base_rates[pid] for pid, r in rates.items()
                                                  if pid in base_rates}


def format_tables(result: dict) -> str:
    """Markdown: the machine and command line, one table per greedy method that is not a baseline or an ablation
    variant (rows: categories, all), then the ablation table and the sampled table when those methods ran.

    `result` is `run_suite`'s dict plus `machine` (`machine_info`), `model` (a name) and `command` (a string).
    """
    methods = result["settings"]["methods"]
    plain = [m for m in methods if m not in ABLATION and m not in SAMPLED_METHODS]
    subjects = [m for m in plain if m not in BASELINES] or [m for m in plain if m != REFERENCE] or plain
    lines = [_machine_line(result), "", f"Command: `{result['command']}`", ""]
    for method in subjects:
        lines += _method_table(result, method) + [""]
    if any(m in ABLATION for m in methods):
        lines += _ablation_table(result) + [""]
    if all(m in methods for m in SAMPLED_METHODS):
        lines += _sampled_table(result) + [""]
    return "\n".join(lines).rstrip() + "\n"


def _machine_line(result: dict) -> str:
    """One line naming the machine, library versions, threads, dtype, model and run sizes."""
    settings, machine = result["settings"], result["machine"]
    load = machine["load_average"]
    return (f"CPU: {machine['cpu']} ({machine['cpu_count']} cores), {machine['threads']} threads, "
            f"{settings['dtype']}; torch {machine['torch']}, transformers {machine['transformers']}, "
            f"lookahead {machine['lookahead']}; model: {result['model']}; max {settings['max_new_tokens']} new tokens, "
            f"repetitions: {settings['repeats']}; load average " + " → ".join(f"{x:.1f}" for x in load))


def _method_table(result: dict, method: str) -> list[str]:
    """Rows of one method's markdown table: tok/s of the baselines and the method, speedups over HF greedy, HF
    prompt lookup and lookahead's own loop without speculation, tok/step (observed and predicted), identity."""
    summary = result["summary"]
    header = ["category", "prompts", "HF greedy tok/s", "HF prompt lookup tok/s", f"{method} tok/s",
              "× greedy (median / min)", "× prompt lookup (median / min)", "× mode off (median / min)",
              "tokens/step", "predicted tokens/step", "identical"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for group, per_method in summary.items():
        entry = per_method[method]
        cells = [group if group != "all" else "**all**", str(entry["prompts"]),
                 _rate(per_method.get("hf_greedy")), _rate(per_method.get("hf_prompt_lookup")), _rate(entry),
                 _speedup(entry, "hf_greedy"), _speedup(entry, "hf_prompt_lookup"), _speedup(entry, "lookahead_off"),
                 f"{entry['tokens_per_step']:.2f}", _number(entry.get("expected_tokens_per_step")),
                 f"{entry['identical_runs']}/{entry['checked_runs']}" if entry["checked_runs"] else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _ablation_table(result: dict) -> list[str]:
    """Each drafter alone and all together: per category, tokens/step and speedup over HF greedy (median)."""
    methods = [m for m in result["settings"]["methods"] if m in ABLATION or m == "lookahead"]
    names = [m.removeprefix("lookahead_") if m != "lookahead" else "all" for m in methods]
    header = ["category", *(f"{n}: tok/step · × greedy" for n in names), "all: rows/step"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for group, per_method in result["summary"].items():
        cells = [group if group != "all" else "**all**"]
        for method in methods:
            entry = per_method[method]
            ratio = entry.get("speedup_vs_hf_greedy")
            cells.append(f"{entry['tokens_per_step']:.2f} · " + (f"{ratio:.2f}x" if ratio else "–"))
        cells.append(_number(per_method.get("lookahead", {}).get("rows_per_step"), 1))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _sampled_table(result: dict) -> list[str]:
    """Sampled rows: HF sampling vs seeded lookahead sampling, tokens/s and speedup (speed only)."""
    header = ["category (sampled)", "HF sampling tok/s", "lookahead tok/s", "× HF sampling (median / min)",
              "tokens/step", "predicted tokens/step"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for group, per_method in result["summary"].items():
        entry = per_method["lookahead_sample"]
        cells = [group if group != "all" else "**all**", _rate(per_method.get("hf_sample")), _rate(entry),
                 _speedup(entry, "hf_sample"), f"{entry['tokens_per_step']:.2f}",
                 _number(entry.get("expected_tokens_per_step"))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _number(value: float | None, digits: int = 2) -> str:
    """`value` with `digits` decimals, or a dash for None."""
    return "–" if value is None else f"{value:.{digits}f}"


def _rate(entry: dict | None) -> str:
    """Median-based tokens/s of a method's summary entry, or a dash when the method did not run."""
    return f"{entry['tokens_per_second']:.1f}" if entry and entry["runs"] else "–"


def _speedup(entry: dict, baseline: str) -> str:
    """'2.10x / 2.25x' (median / min based) against `baseline`, or a dash."""
    key = f"speedup_vs_{baseline}"
    return f"{entry[key]:.2f}x / {entry[key + '_min']:.2f}x" if key in entry else "–"


def machine_info(threads: int) -> dict:
    """CPU model, core count, threads, 1-minute load average (a list: main appends the value at the end),
    and the Python/torch/transformers/lookahead versions."""
    import transformers

    import lookahead

    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "threads": threads,
            "load_average": [os.getloadavg()[0]], "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "lookahead": lookahead.__version__}


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def parse_overrides(pairs: list[str]) -> dict:
    """`["window_levels=3", "pool_from_text=false"]` → `{"window_levels": 3, "pool_from_text": False}`.

    Values are parsed by the type of the field's default in `LookaheadConfig`. Raises `ValueError` naming the
    bad pair, an unknown field (with the valid ones) or a value of the wrong type.
    """
    from lookahead import LookaheadConfig

    defaults = LookaheadConfig().as_dict()
    overrides = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name:
            raise ValueError(f"--config expects key=value, got {pair!r}")
        if name not in defaults:
            raise ValueError(f"unknown lookahead option {name!r}; valid options: {sorted(defaults)}")
        kind = int if defaults[name] is None else type(defaults[name])  # None-default fields are ints (seed)
        overrides[name] = _parse_value(name, value, kind)
    return overrides


def _parse_value(name: str, value: str, kind: type):
    """Parse `value` as a `kind` (bool, int, float or str); raises `ValueError` naming `name`."""
    if kind is bool:
        words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
        if value.lower() not in words:
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return words[value.lower()]
    if kind not in (int, float, str):
        raise ValueError(f"{name} cannot be set from the command line (a {kind.__name__} field)")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name} must be {kind.__name__}, got {value!r}") from None


def write_json(result: dict, path: Path) -> None:
    """Write `result` to `path` (through a .tmp file renamed into place), creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    partial.replace(path)


def _check_suite_args(methods, repeats: int, max_new_tokens: int, prompts: list, draft_model) -> None:
    """Raise `ValueError` naming the first bad suite argument."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods or len(set(methods)) != len(methods):
        raise ValueError(f"methods must be distinct names from {list(METHODS)}, got {list(methods)}")
    needing = [m for m in methods if m in DRAFT_METHODS]
    if needing and draft_model is None:
        raise ValueError(f"method {needing[0]} needs a draft model (--draft-model PATH or --draft-layers N)")
    if repeats < 1 or max_new_tokens < 1 or not prompts:
        raise ValueError(f"need repeats >= 1, max_new_tokens >= 1 and prompts (got {repeats}, {max_new_tokens}, "
                         f"{len(prompts)} prompts)")


def _progress_bar(total: int, enabled: bool):
    """A tqdm bar on stderr (a no-op bar when disabled)."""
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, file=sys.stderr, unit="run", dynamic_ncols=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = common_parser(__doc__.splitlines()[0], prompts_per_category=4, repeats=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10, help="HF prompt_lookup_num_tokens")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=None, metavar="METHOD",
                        help=f"of {', '.join(METHODS)} (default: {' '.join(DEFAULT_METHODS)}, "
                             f"+ {' '.join(DRAFT_METHODS)} with a draft model)")
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="LookaheadConfig override for the lookahead method (repeatable)")
    drafts = parser.add_mutually_exclusive_group()
    drafts.add_argument("--draft-model", default=None, help="draft model (same tokenizer) for hf_assisted and "
                                                            "lookahead_draft")
    drafts.add_argument("--draft-layers", type=int, default=None,
                        help="self-speculative draft: the model's own first N layers and LM head")
    parser.add_argument("--ablation", action="store_true",
                        help=f"add each model-free drafter alone: {' '.join(ABLATION)}")
    parser.add_argument("--sample", action="store_true",
                        help="add sampled runs (T=0.7, top_p=0.95): hf_sample and lookahead_sample (seeded)")
    parser.add_argument("--warm-recycle", action="store_true",
                        help="keep the recycling tables as they are between runs (default: each run of a prompt "
                             "starts from the table as it stood before that prompt's first run)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/<time>.json)")
    parser.add_argument("--plots", action="store_true", help="also save PNG plots next to the JSON")
    args = parser.parse_args(argv)
    has_draft = args.draft_model is not None or args.draft_layers is not None
    if args.methods is None:
        args.methods = [*DEFAULT_METHODS, *(DRAFT_METHODS if has_draft else ())]
    extra = [*(ABLATION if args.ablation else ()), *(SAMPLED_METHODS if args.sample else ())]
    args.methods += [m for m in extra if m not in args.methods]
    needing = [m for m in args.methods if m in DRAFT_METHODS]
    if needing and not has_draft:
        parser.error(f"--methods {needing[0]} needs --draft-model PATH or --draft-layers N")
    if args.draft_layers is not None and args.draft_layers < 1:
        parser.error(f"--draft-layers must be at least 1, got {args.draft_layers}")
    return finish_args(parser, args, ("prompts_per_category", "max_new_tokens", "repeats", "threads",
                                      "prompt_lookup_tokens"))


def common_parser(description: str, prompts_per_category: int, repeats: int,
                  categories: tuple[str, ...] = DEFAULT_CATEGORIES) -> argparse.ArgumentParser:
    """The options every benchmark script takes: model, categories, prompts, lengths, repeats, threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M)")
    parser.add_argument("--categories", nargs="+", default=list(categories), choices=list(CATEGORIES),
                        metavar="CATEGORY", help=f"of {', '.join(CATEGORIES)} (default: {' '.join(categories)})")
    parser.add_argument("--prompts-per-category", type=int, default=prompts_per_category)
    parser.add_argument("--prompts-dir", type=Path, default=DEFAULT_PROMPTS_DIR)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    return parser


def finish_args(parser: argparse.ArgumentParser, args: argparse.Namespace, positive: tuple[str, ...]):
    """Checks the benchmark scripts share: the `positive` counts are >= 1; `--config` overrides become
    `args.lookahead_config`; the prompts are loaded into `args.prompts`. Errors go through `parser.error`."""
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    try:
        from lookahead import LookaheadConfig

        args.lookahead_config = LookaheadConfig().with_overrides(**parse_overrides(args.config))
        args.prompts = load_prompts(args.categories, args.prompts_per_category, args.prompts_dir)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the suite from the command line; print the markdown tables and write the JSON (and plots)."""
    args = parse_args(argv)
    from lookahead import load_model

    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model, tokenizer = load_model(args.model, dtype=dtype)
    draft_model = load_draft(model, args.draft_model, args.draft_layers, dtype)
    machine = machine_info(args.threads)
    result = run_suite(model, tokenizer, args.prompts, args.methods, args.repeats, args.max_new_tokens,
                       args.lookahead_config, prompt_lookup_tokens=args.prompt_lookup_tokens,
                       draft_model=draft_model, warm_recycle=args.warm_recycle)
    machine["load_average"].append(os.getloadavg()[0])
    from lookahead.cost_curve import cost_curve_for

    result["cost_curve"] = json.loads(cost_curve_for(model).to_json())
    draft_name = f"first {args.draft_layers} layers of the model" if args.draft_layers else args.draft_model
    result = {"command": command_line(), "model": args.model or "SmolLM2-135M-Instruct (embedded default)",
              "draft_model": draft_name, "machine": machine,
              "date": datetime.datetime.now().isoformat(timespec="seconds"), **result}
    out = args.out or RESULTS_DIR / f"bench-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    write_json(result, out)
    print(format_tables(result))
    print(f"results: {out}", file=sys.stderr)
    if args.plots:
        from plots import save_plots

        for path in save_plots(result, out):
            print(f"plot: {path}", file=sys.stderr)


def load_draft(model, path: str | None, layers: int | None, dtype: torch.dtype):
    """The draft model: loaded from `path`, or the early-exit draft of `model`'s first `layers` layers, or None."""
    from lookahead import load_model
    from lookahead.draft_model import check_draft_model, early_exit_draft

    if layers is not None:
        return early_exit_draft(model, layers)
    if path is None:
        return None
    draft = load_model(path, dtype=dtype)[0]
    check_draft_model(model, draft)
    return draft


def command_line(interpreter: str = "python") -> str:
    """The command that ran this script, with the script path relative to the working directory if possible."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.join([interpreter, str(script), *sys.argv[1:]])


if __name__ == "__main__":
    main()
