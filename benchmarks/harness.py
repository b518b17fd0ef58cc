"""What every benchmark script shares: the common options and their checks, the machine and command line a result
records, progress bars, the result JSON, markdown tables, and the interleaved run loop and its summary (the
speed suite's and the lade comparison's).

This module must stay importable in the lade environment (transformers 4.34, no lookahead, maybe no tqdm):
lookahead, transformers and tqdm are imported inside functions only.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from prompts import CATEGORIES, DEFAULT_CATEGORIES, DEFAULT_PROMPTS_DIR, Prompt, load_prompts

# No kernel-compile helper process (`lookahead.kernel_warmup`) beside a benchmark: on a fresh installation its
# kernels compile in the untimed warm-up runs instead, never while a baseline is timed.
os.environ["LOOKAHEAD_KERNEL_WARMUP"] = "0"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REFERENCE = "hf_greedy"  # outputs of every other greedy method are compared with it, token for token


# ---- command line ----

def common_parser(description: str, prompts_per_category: int, repeats: int,
                  categories: tuple[str, ...] = DEFAULT_CATEGORIES, model: bool = True) -> argparse.ArgumentParser:
    """The options every suite script takes: model (unless `model` is False: the script adds its own),
    categories, prompts, lengths, repeats, threads."""
    parser = argparse.ArgumentParser(description=description)
    if model:
        parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M)")
    parser.add_argument("--categories", nargs="+", default=list(categories), choices=list(CATEGORIES),
                        metavar="CATEGORY", help=f"of {', '.join(CATEGORIES)} (default: {' '.join(categories)})")
    parser.add_argument("--prompts-per-category", type=int, default=prompts_per_category)
    parser.add_argument("--skip-prompts", type=int, default=0, metavar="N",
                        help="leave out each category's first N prompts: a held-out run (lookahead's defaults "
                             "were tuned on the suite's first prompts)")
    parser.add_argument("--prompts-dir", type=Path, default=DEFAULT_PROMPTS_DIR)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    return parser


def rows_parser(description: str, repeats: int) -> argparse.ArgumentParser:
    """The options of the scripts that time forwards of k rows: model, row counts (the first is the one-row
    reference), repeats, threads and the JSON path."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded default model)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    return parser


def load_target(args: argparse.Namespace, dtype: torch.dtype = torch.float32):
    """Set torch's thread count to `args.threads`, then `(model, tokenizer)` of `args.model` (None: the embedded
    default) with lookahead's loader."""
    from lookahead import load_model

    torch.set_num_threads(args.threads)
    return load_model(args.model, dtype=dtype)


def finish_args(parser: argparse.ArgumentParser, args: argparse.Namespace, positive: tuple[str, ...]):
    """Checks the suite scripts share: the `positive` counts are >= 1; `--config` overrides become
    `args.lookahead_config`; the prompts are loaded into `args.prompts`. Errors go through `parser.error`."""
    try:
        check_counts(args, positive)
        from lookahead import LookaheadConfig

        args.lookahead_config = LookaheadConfig().with_overrides(**parse_overrides(args.config))
        args.prompts = load_prompts(args.categories, args.prompts_per_category, args.prompts_dir, args.skip_prompts)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def check_counts(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """Raise `ValueError` naming the first option of `names` (attribute names) that is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


def parse_overrides(pairs: list[str]) -> dict:
    """`["window_levels=3", "pool_from_text=false"]` → `{"window_levels": 3, "pool_from_text": False}`.

    Values are parsed by the type of the field's default in `LookaheadConfig`. Raises `ValueError` naming the
    bad pair, an unknown field (with the valid ones) or a value of the wrong type.
    """
    from lookahead import LookaheadConfig

    defaults = LookaheadConfig().as_dict()
    annotations = {f.name: str(f.type) for f in dataclasses.fields(LookaheadConfig)}
    overrides = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name:
            raise ValueError(f"--config expects key=value, got {pair!r}")
        if name not in defaults:
            raise ValueError(f"unknown lookahead option {name!r}; valid options: {sorted(defaults)}")
        # a None default takes its annotation's type: `str | None` (draft_head) a string, `int | None` (seed) an int
        kind = type(defaults[name]) if defaults[name] is not None else \
            str if annotations[name].startswith("str") else int
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


def command_line(interpreter: str = "python") -> str:
    """The command that ran this script, with the script path relative to the working directory if possible."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.join([interpreter, str(script), *sys.argv[1:]])


# ---- the machine ----

def machine_info(threads: int, decoder: str = "lookahead") -> dict:
    """CPU model, its vector-instruction flags (`cpu_flags`), core count, threads, 1-minute load average (a list:
    a script may append the value at the end), and the Python/torch/transformers versions and that of `decoder`,
    the package under test (`lookahead`, or `lade` in its own environment)."""
    import transformers

    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cpu_count": os.cpu_count(), "threads": threads,
            "load_average": [os.getloadavg()[0]], "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, decoder: _version(decoder)}


def close_load_average(machine: dict) -> None:
    """Append the 1-minute load average at the end of a run to `machine_info`'s list."""
    machine["load_average"].append(os.getloadavg()[0])


def _version(package: str) -> str:
    """lookahead's `__version__`, or the installed version of another distribution (lade has no __version__)."""
    if package == "lookahead":
        import lookahead

        return lookahead.__version__
    from importlib.metadata import version

    return version(package)


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The CPU's vector-instruction flags that matter for these kernels (avx*, fma, amx*, *vnni*, *bf16*)."""
    flags = (_cpuinfo("flags") or "").split()
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")) or "vnni" in f or "bf16" in f)


def _cpuinfo(field: str) -> str | None:
    """The value of the first `field` line of /proc/cpuinfo, or None (no such line, or not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_line(result: dict, decoder: str = "lookahead") -> str:
    """One line naming the machine, library versions (`decoder`'s too), threads, dtype, model and run sizes."""
    settings, machine = result["settings"], result["machine"]
    flags = " ".join(machine.get("cpu_flags", [])) or "unknown"  # results written before the flags were recorded
    return (f"CPU: {machine['cpu']} ({machine['cpu_count']} cores; flags {flags}), {machine['threads']} threads, "
            f"{settings['dtype']}; torch {machine['torch']}, transformers {machine['transformers']}, "
            f"{decoder} {machine[decoder]}; model: {result['model']}; max {settings['max_new_tokens']} new tokens, "
            f"repetitions: {settings['repeats']}; load average "
            + " → ".join(f"{x:.1f}" for x in machine["load_average"]))


# ---- results ----

def headed(result: dict, machine: dict, interpreter: str = "python", **fields) -> dict:
    """`result` behind the header every suite result starts with: the command line, `fields` (e.g. the model),
    the machine and the date."""
    return {"command": command_line(interpreter), **fields, "machine": machine,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), **result}


def default_out(prefix: str) -> Path:
    """`benchmarks/results/<prefix>-<date>-<time>.json`."""
    return RESULTS_DIR / f"{prefix}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"


def write_json(result: dict, path: Path) -> None:
    """Write `result` to `path` (through a .tmp file renamed into place), creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    partial.replace(path)


def publish(result: dict, out: Path, tables: str) -> None:
    """Write `result` to `out`, print the markdown `tables` and name the file on stderr."""
    write_json(result, out)
    print(tables)
    print(f"results: {out}", file=sys.stderr)


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Lines of a markdown table: `header`, the first column left-aligned and the others right-aligned, `rows`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    return lines + ["| " + " | ".join(cells) + " |" for cells in rows]


def group_name(group: str) -> str:
    """A summary group as a table cell: the category, or **all**."""
    return group if group != "all" else "**all**"


def speedup_cell(entry: dict, baseline: str, measure: str = "") -> str:
    """'2.10x / 2.25x' (median / min based) against `baseline`, or a dash; `measure="decode"` gives the
    speedups from the first new token on."""
    key = f"speedup_{measure}_vs_{baseline}" if measure else f"speedup_vs_{baseline}"
    return f"{entry[key]:.2f}x / {entry[key + '_min']:.2f}x" if key in entry else "–"


# ---- progress ----

class PlainProgress:
    """A minimal progress indicator on stderr for when tqdm is missing (same `update`/`close` calls)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled

    def update(self) -> None:
        """Count one finished run."""
        self.done += 1
        if self.enabled:
            print(f"\r{self.done}/{self.total} runs", end="", file=sys.stderr, flush=True)

    def set_postfix_str(self, text: str) -> None:
        """Ignored (tqdm shows the current prompt and method here)."""

    def close(self) -> None:
        """End the progress line."""
        if self.enabled:
            print(file=sys.stderr)


def progress_bar(total: int, enabled: bool = True):
    """A tqdm bar of `total` runs on stderr if tqdm is installed, else a plain `done/total` counter (silent when
    disabled)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainProgress(total, enabled)
    return tqdm(total=total, disable=not enabled, file=sys.stderr, unit="run", dynamic_ncols=True)


# ---- the interleaved run loop ----

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


class FirstTokenClock:
    """A streamer (transformers' `put`/`end` protocol) that notes when the first new token arrives: `put` gets the
    prompt first, then new tokens; `first` is the `time.perf_counter()` of the first call after the prompt."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        """Count a call; the second one carries the first new token(s)."""
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        """Nothing to flush."""


def timed_run(model, input_ids: torch.Tensor, method: str, max_new_tokens: int, counter: ForwardCounter,
              clock_first_token: bool = False, **generate_kwargs) -> dict:
    """Generate once from `input_ids` ([1, L]) with `generate_kwargs` and measure it.

    Returns `method`, `seconds`, `prompt_tokens`, `new_tokens`, `tokens_per_second`, `forwards` (target forwards
    counted by `counter`, prefill included), `tokens_per_step` (new tokens after the first, per target forward
    after the first) and `tokens` (the new token ids). With `clock_first_token`, a `FirstTokenClock` streamer
    rides along (as `lookahead_streamer=` for a `custom_generate` decoder, which HF does not hand `streamer=`)
    and `first_token_seconds` is the time from the call to the first new token (the prompt's prefill and one
    draw), else None.
    """
    clock = FirstTokenClock() if clock_first_token else None
    if clock is not None:
        generate_kwargs["lookahead_streamer" if "custom_generate" in generate_kwargs else "streamer"] = clock
    counter.count = 0
    start = time.perf_counter()
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                            **generate_kwargs)  # [1, L + new]
    seconds = time.perf_counter() - start
    tokens = output[0, input_ids.shape[1]:].tolist()
    steps = counter.count - 1
    first = clock.first - start if clock is not None and clock.first is not None else None
    return {"method": method, "seconds": seconds, "prompt_tokens": int(input_ids.shape[1]),
            "new_tokens": len(tokens), "tokens_per_second": len(tokens) / seconds, "forwards": counter.count,
            "tokens_per_step": (len(tokens) - 1) / steps if steps > 0 else 1.0, "tokens": tokens,
            "first_token_seconds": first}


def prompt_records(prompts: list[Prompt], encoded: list[torch.Tensor]) -> list[dict]:
    """The `prompts` entry of a suite result: id, category, chat flag and token count of each encoded prompt."""
    return [{"id": p.id, "category": p.category, "chat": p.chat, "prompt_tokens": int(ids.shape[1])}
            for p, ids in zip(prompts, encoded)]


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


# ---- the summary ----

def summarize(runs: list[dict], methods, baselines: tuple[str, ...] = (REFERENCE,),
              sampled_baselines: tuple[str, ...] = ()) -> dict:
    """Per group (each category, then "all") and method: times, rates and speedups (see `_method_summary`).

    Speedups (`speedup_vs_<baseline>`, see `_add_speedups`) are against every method of `baselines` that ran for
    greedy methods, and of `sampled_baselines` for sampled ones."""
    groups = list(dict.fromkeys(run["category"] for run in runs))  # in run (= prompt) order
    summary = {}
    for group in [*groups, "all"]:
        members = [run for run in runs if group in ("all", run["category"])]
        by_method = {m: [run for run in members if run["method"] == m] for m in methods}
        per_method = {m: _method_summary(rs) for m, rs in by_method.items()}
        for method, entry in per_method.items():
            sampled = any(run.get("sampled") for run in by_method[method])
            for baseline in sampled_baselines if sampled else baselines:
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


def decode_seconds_per_token(run: dict) -> float | None:
    """Seconds per new token after the first (the prompt's prefill and first draw left out), or None when the run
    did not clock its first token or made fewer than 2."""
    first = run.get("first_token_seconds")
    if first is None or run["new_tokens"] < 2:
        return None
    return (run["seconds"] - first) / (run["new_tokens"] - 1)


def _prompt_decode_times(runs: list[dict], reduce) -> dict[str, float]:
    """Per prompt id, `reduce` (median or min) of the decode seconds per token of its runs that have one."""
    by_prompt: dict[str, list[float]] = {}
    for run in runs:
        if (per_token := decode_seconds_per_token(run)) is not None:
            by_prompt.setdefault(run["prompt_id"], []).append(per_token)
    return {pid: reduce(times) for pid, times in by_prompt.items()}


def _decode_rate(runs: list[dict], reduce) -> float | None:
    """Decode tokens per second over the prompts: their count over the sum of per-prompt `reduce`d seconds per
    token (each prompt weighs the same, as its runs' lengths may differ); None without clocked runs."""
    times = _prompt_decode_times(runs, reduce)
    return len(times) / sum(times.values()) if times else None


def _method_summary(runs: list[dict]) -> dict:
    """Aggregate the runs of one method over a group of prompts.

    `time_median_s` / `time_min_s` are sums over prompts of the per-prompt median / min over repetitions;
    `tokens_per_second` divides the summed per-prompt median new tokens by `time_median_s`; `tokens_per_step`
    is tokens committed per target forward after the prefill, pooled over all runs; `identical_rate` is None
    when no run was checked. Lookahead methods add `rows_per_step` (rows verified per decoding step) and
    `expected_tokens_per_step` (the planner's mean prediction over the steps it predicted), pooled.
    `decode_tokens_per_second` (`..._best`) is `_decode_rate` by the median (min) time: None for runs that did
    not clock their first token.
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
        "decode_tokens_per_second": _decode_rate(runs, statistics.median),
        "decode_tokens_per_second_best": _decode_rate(runs, min),
        "identical_runs": sum(checked), "checked_runs": len(checked),
        "identical_rate": sum(checked) / len(checked) if checked else None,
    }


def _add_speedups(entry: dict, base: dict, baseline: str, runs: list[dict], base_runs: list[dict]) -> None:
    """Add `speedup_vs_<baseline>` (ratio of the median-based tokens/s), `..._min` (of the min-based ones) and
    `speedup_per_prompt_vs_<baseline>` (per prompt, ratio of median tokens / median time) to `entry`. With
    identical outputs these are ratios of times; sampled outputs differ in length, so rates are compared.

    When both clocked their first tokens, `speedup_decode_vs_<baseline>` (`..._min`, `speedup_decode_per_prompt_
    vs_<baseline>`) compare the same from the first new token on: sampled runs of different lengths otherwise
    spread the one prefill over different token counts, which favours the longer output."""
    entry[f"speedup_vs_{baseline}"] = entry["tokens_per_second"] / base["tokens_per_second"]
    entry[f"speedup_vs_{baseline}_min"] = entry["tokens_per_second_best"] / base["tokens_per_second_best"]
    rates, base_rates = _prompt_rates(runs), _prompt_rates(base_runs)
    entry[f"speedup_per_prompt_vs_{baseline}"] = {pid: r / base_rates[pid] for pid, r in rates.items()
                                                  if pid in base_rates}
    if entry["decode_tokens_per_second"] and base["decode_tokens_per_second"]:
        entry[f"speedup_decode_vs_{baseline}"] = entry["decode_tokens_per_second"] / base["decode_tokens_per_second"]
        entry[f"speedup_decode_vs_{baseline}_min"] = (entry["decode_tokens_per_second_best"]
                                                      / base["decode_tokens_per_second_best"])
        times = _prompt_decode_times(runs, statistics.median)
        base_times = _prompt_decode_times(base_runs, statistics.median)
        entry[f"speedup_decode_per_prompt_vs_{baseline}"] = {pid: base_times[pid] / t for pid, t in times.items()
                                                             if pid in base_times}
