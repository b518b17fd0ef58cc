"""Speed suite: HF greedy, HF prompt lookup, HF assisted generation and lookahead (model-free, its own loop with
speculation off, each model-free drafter alone, with the draft model when one is given, and sampled) on the same
prompts.

    python benchmarks/bench_generate.py [--model PATH] [--categories code rag ...] [--prompts-per-category 4]
        [--skip-prompts N] [--max-new-tokens 128] [--repeats 2] [--threads 2] [--methods hf_greedy lookahead ...]
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
the end are ready for the README, each followed by a per-prompt line (lowest and highest speedup, and which
prompts ran below 1.0x by median and by best time); the JSON holds every run, the summary, the settings, the
machine and the command line.

Token recycling keeps its table across the calls of one `Lookahead` object. So that a repetition never drafts
from its own earlier output, each run starts from the table as it stood before that prompt's first run (warm
from the earlier prompts only); `--warm-recycle` keeps the table as it is instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from harness import (REFERENCE, ForwardCounter, close_load_average, common_parser, decode_seconds_per_token,
                     default_out, finish_args, group_name, headed, interleaved_runs, load_target, machine_info,
                     machine_line, markdown_table, progress_bar, prompt_records, publish, speedup_cell, summarize,
                     timed_run)
from prompts import Prompt, encode

# Each model-free drafter alone (`--ablation`), as overrides of the `lookahead` config. The window's n-grams reach
# the tree through the pool, so the window runs with a pool fed by the window only.
ABLATION = {
    "lookahead_prompt": dict(window_levels=0, pool_candidates=0, recycle_nodes=0),
    "lookahead_pool": dict(window_levels=0, prompt_candidates=0, recycle_nodes=0),
    "lookahead_window": dict(pool_from_text=False, prompt_candidates=0, recycle_nodes=0),
    "lookahead_recycle": dict(window_levels=0, pool_candidates=0, prompt_candidates=0),
}
HEAD_METHOD = "lookahead_head"  # `--head`: the lookahead config with the learned draft head shipped for the model
NO_PRIOR_METHOD = "lookahead_no_prior"  # the lookahead config without the recycling prior shipped for the model
PAIRS_METHOD = "lookahead_pairs"  # the lookahead config with recycled rows per token pair (`recycle_pairs`)
SAMPLED_METHODS = ("hf_sample", "lookahead_sample")  # `--sample`
SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.95)
SAMPLE_SEED = 1234  # lookahead_sample's Gumbel seed
METHODS = ("hf_greedy", "hf_prompt_lookup", "hf_assisted", "lookahead", "lookahead_draft", "lookahead_off",
           "lookahead_fp32_head", HEAD_METHOD, NO_PRIOR_METHOD, PAIRS_METHOD, *ABLATION, *SAMPLED_METHODS)
DEFAULT_METHODS = ("hf_greedy", "hf_prompt_lookup", "lookahead", "lookahead_off")
DRAFT_METHODS = ("hf_assisted", "lookahead_draft")  # need a draft model; added to the defaults when one is given
# Speedups are reported against each baseline that ran: sampled methods against HF sampling only, greedy ones
# against the others.
BASELINES = ("hf_greedy", "hf_prompt_lookup", "lookahead_off")
SAMPLED_BASELINES = ("hf_sample",)


def run_suite(model, tokenizer, prompts: list[Prompt], methods, repeats: int, max_new_tokens: int,
              config, *, prompt_lookup_tokens: int = 10, draft_model=None, progress: bool = True,
              warm_recycle: bool = False) -> dict:
    """Run every method on every prompt `repeats` times (interleaved) and summarize.

    `config` is the `LookaheadConfig` of the `lookahead` method (`lookahead_off` always uses
    `LookaheadConfig.off()`, `lookahead_fp32_head` turns the bounded int8 LM head off (`argmax_head.py`: the A/B
    of that head, which runs only on heads held as float32 panels), `lookahead_no_prior` turns the recycling prior
    off (`recycle_prior.py`: its A/B), `lookahead_pairs` turns recycled rows per token pair on (`recycle_pairs.py`),
    `lookahead_draft` adds `draft_model`, the ablation methods override it with
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
    bar = progress_bar(len(methods) * (1 + repeats * len(prompts)), progress)
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
        "prompts": prompt_records(prompts, encoded),
        "runs": runs,
        "summary": summarize(runs, methods, BASELINES, SAMPLED_BASELINES),
    }


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
        "lookahead_fp32_head": lambda: {"custom_generate": Lookahead(config.with_overrides(argmax_head=False))},
        HEAD_METHOD: lambda: {"custom_generate": Lookahead(config.with_overrides(draft_head="auto"))},
        NO_PRIOR_METHOD: lambda: {"custom_generate": Lookahead(config.with_overrides(recycle_prior=None))},
        PAIRS_METHOD: lambda: {"custom_generate": Lookahead(config.with_overrides(recycle_pairs=True))},
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


def _timed_run(model, input_ids: torch.Tensor, method: str, kwargs: dict, max_new_tokens: int,
               counter: ForwardCounter) -> dict:
    """Generate once (greedy unless `kwargs` sample) and measure it: `harness.timed_run`'s fields, then `stats`
    (`DecodeStats.as_dict()` for lookahead methods, else None) and `sampled`."""
    kwargs = {"do_sample": False, **kwargs}
    run = timed_run(model, input_ids, method, max_new_tokens, counter, clock_first_token=True, **kwargs)
    decoder = kwargs.get("custom_generate")
    return {**run, "stats": decoder.last_stats.as_dict() if decoder is not None else None,
            "sampled": bool(kwargs["do_sample"])}


def format_tables(result: dict) -> str:
    """Markdown: the machine and command line, one table per greedy method that is not a baseline or an ablation
    variant (rows: categories, all), then the ablation table and the sampled table when those methods ran.

    `result` is `run_suite`'s dict plus `machine` (`machine_info`), `model` (a name) and `command` (a string).
    """
    methods = result["settings"]["methods"]
    plain = [m for m in methods if m not in ABLATION and m not in SAMPLED_METHODS]
    subjects = [m for m in plain if m not in BASELINES] or [m for m in plain if m != REFERENCE] or plain
    lines = [machine_line(result), "", f"Command: `{result['command']}`", ""]
    for method in subjects:
        lines += _method_table(result, method) + [""]
        lines += [line for baseline in ("hf_greedy", "hf_prompt_lookup")
                  if (line := per_prompt_line(result["runs"], method, baseline)) is not None] + [""]
    if any(m in ABLATION for m in methods):
        lines += _ablation_table(result) + [""]
    if all(m in methods for m in SAMPLED_METHODS):
        lines += _sampled_table(result) + [""]
        lines += [line for decode in (False, True)
                  if (line := per_prompt_line(result["runs"], "lookahead_sample", "hf_sample", decode)) is not None]
        lines += [""]
    return "\n".join(lines).rstrip() + "\n"


def per_prompt_ratios(runs: list[dict], method: str, baseline: str,
                      decode: bool = False) -> dict[str, tuple[float, float]]:
    """{prompt id: (speedup from the median times, speedup from the best times)} of `method` over `baseline`
    (baseline seconds per new token / method seconds per new token over the repetitions: sampled runs stop at
    different lengths), for every prompt both ran. With `decode`, seconds per token after the first new token
    (`harness.decode_seconds_per_token`; runs without one are left out)."""
    times: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        per_token = decode_seconds_per_token(run) if decode else run["seconds"] / max(run["new_tokens"], 1)
        if per_token is not None:
            times.setdefault((run["prompt_id"], run["method"]), []).append(per_token)
    ratios = {}
    for (prompt_id, name), seconds in times.items():
        base = times.get((prompt_id, baseline))
        if name == method and base:
            ratios[prompt_id] = (statistics.median(base) / statistics.median(seconds), min(base) / min(seconds))
    return ratios


def per_prompt_line(runs: list[dict], method: str, baseline: str, decode: bool = False) -> str | None:
    """One line: the lowest and highest per-prompt speedup of `method` over `baseline` (median times per new
    token; with `decode`, per token after the first) and how many prompts ran below 1.0x, by the median and by
    the best time; None when no prompt has both."""
    ratios = per_prompt_ratios(runs, method, baseline, decode)
    if not ratios:
        return None
    ordered = sorted(ratios.items(), key=lambda item: item[1][0])
    (low_id, (low, _)), (high_id, (high, _)) = ordered[0], ordered[-1]
    below = [prompt_id for prompt_id, (median, _) in ordered if median < 1.0]
    below_best = sum(best < 1.0 for _, best in ratios.values())
    listed = f" ({', '.join(below)})" if below else ""
    measure = " from the first new token on" if decode else ""
    return (f"Per prompt, {method} vs {baseline}{measure}: {low:.2f}x ({low_id}) to {high:.2f}x ({high_id}); "
            f"{len(below)} of {len(ratios)} below 1.0x by median time{listed}, {below_best} by best time.")


def _method_table(result: dict, method: str) -> list[str]:
    """Rows of one method's markdown table: tok/s of the baselines and the method, speedups over HF greedy (the
    whole call, and from the first new token on: without the prompt's prefill, which both pay alike), HF prompt
    lookup and lookahead's own loop without speculation, tok/step (observed and predicted), identity."""
    summary = result["summary"]
    header = ["category", "prompts", "HF greedy tok/s", "HF prompt lookup tok/s", f"{method} tok/s",
              "× greedy (median / min)", "× greedy from the first token (median / min)",
              "× prompt lookup (median / min)", "× mode off (median / min)",
              "tokens/step", "predicted tokens/step", "identical"]
    rows = []
    for group, per_method in summary.items():
        entry = per_method[method]
        rows.append([group_name(group), str(entry["prompts"]),
                     _rate(per_method.get("hf_greedy")), _rate(per_method.get("hf_prompt_lookup")), _rate(entry),
                     speedup_cell(entry, "hf_greedy"), speedup_cell(entry, "hf_greedy", "decode"),
                     speedup_cell(entry, "hf_prompt_lookup"),
                     speedup_cell(entry, "lookahead_off"), f"{entry['tokens_per_step']:.2f}",
                     _number(entry.get("expected_tokens_per_step")),
                     f"{entry['identical_runs']}/{entry['checked_runs']}" if entry["checked_runs"] else "–"])
    return markdown_table(header, rows)


def _ablation_table(result: dict) -> list[str]:
    """Each drafter alone and all together: per category, tokens/step and speedup over HF greedy (median)."""
    methods = [m for m in result["settings"]["methods"] if m in ABLATION or m == "lookahead"]
    names = [m.removeprefix("lookahead_") if m != "lookahead" else "all" for m in methods]
    header = ["category", *(f"{n}: tok/step · × greedy" for n in names), "all: rows/step"]
    rows = []
    for group, per_method in result["summary"].items():
        cells = [group_name(group)]
        for method in methods:
            entry = per_method[method]
            ratio = entry.get("speedup_vs_hf_greedy")
            cells.append(f"{entry['tokens_per_step']:.2f} · " + (f"{ratio:.2f}x" if ratio else "–"))
        cells.append(_number(per_method.get("lookahead", {}).get("rows_per_step"), 1))
        rows.append(cells)
    return markdown_table(header, rows)


def _sampled_table(result: dict) -> list[str]:
    """Sampled rows: HF sampling vs seeded lookahead sampling, tokens/s and speedup over the whole call and from
    the first new token on (the outputs differ in length, so one prefill weighs differently), tokens/step."""
    header = ["category (sampled)", "HF sampling tok/s", "lookahead tok/s", "× HF sampling (median / min)",
              "× HF sampling from the first token (median / min)", "tokens/step", "predicted tokens/step"]
    rows = []
    for group, per_method in result["summary"].items():
        entry = per_method["lookahead_sample"]
        rows.append([group_name(group), _rate(per_method.get("hf_sample")), _rate(entry),
                     speedup_cell(entry, "hf_sample"), speedup_cell(entry, "hf_sample", "decode"),
                     f"{entry['tokens_per_step']:.2f}", _number(entry.get("expected_tokens_per_step"))])
    return markdown_table(header, rows)


def _number(value: float | None, digits: int = 2) -> str:
    """`value` with `digits` decimals, or a dash for None."""
    return "–" if value is None else f"{value:.{digits}f}"


def _rate(entry: dict | None) -> str:
    """Median-based tokens/s of a method's summary entry, or a dash when the method did not run."""
    return f"{entry['tokens_per_second']:.1f}" if entry and entry["runs"] else "–"


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
    parser.add_argument("--head", action="store_true",
                        help=f"add {HEAD_METHOD}: lookahead with the learned draft head shipped for the model")
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
    extra = [*((HEAD_METHOD,) if args.head else ()), *(ABLATION if args.ablation else ()),
             *(SAMPLED_METHODS if args.sample else ())]
    args.methods += [m for m in extra if m not in args.methods]
    needing = [m for m in args.methods if m in DRAFT_METHODS]
    if needing and not has_draft:
        parser.error(f"--methods {needing[0]} needs --draft-model PATH or --draft-layers N")
    if args.draft_layers is not None and args.draft_layers < 1:
        parser.error(f"--draft-layers must be at least 1, got {args.draft_layers}")
    return finish_args(parser, args, ("prompts_per_category", "max_new_tokens", "repeats", "threads",
                                      "prompt_lookup_tokens"))


def main(argv: list[str] | None = None) -> None:
    """Run the suite from the command line; print the markdown tables and write the JSON (and plots)."""
    args = parse_args(argv)
    from lookahead.calibration import cost_curve_for
    from lookahead.hf import generation_arithmetic
    from lookahead.models import load_draft

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model, tokenizer = load_target(args, dtype)
    draft_model = load_draft(model, tokenizer, args.draft_model, args.draft_layers, dtype)
    machine = machine_info(args.threads)
    result = run_suite(model, tokenizer, args.prompts, args.methods, args.repeats, args.max_new_tokens,
                       args.lookahead_config, prompt_lookup_tokens=args.prompt_lookup_tokens,
                       draft_model=draft_model, warm_recycle=args.warm_recycle)
    close_load_average(machine)
    result["settings"]["skip_prompts"] = args.skip_prompts  # held out: each category's first N left out
    with generation_arithmetic(model, args.lookahead_config):  # the curve the lookahead runs planned on
        result["cost_curve"] = json.loads(cost_curve_for(model, rows=args.lookahead_config.step_rows).to_json())
    draft_name = f"first {args.draft_layers} layers of the model" if args.draft_layers else args.draft_model
    result = headed(result, machine, model=args.model or "SmolLM2-135M-Instruct (embedded default)",
                    draft_model=draft_name)
    out = args.out or default_out("bench")
    publish(result, out, format_tables(result))
    if args.plots:
        from plots import save_plots

        for path in save_plots(result, out):
            print(f"plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
