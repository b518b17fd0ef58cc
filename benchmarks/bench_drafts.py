"""Timing-free comparison of drafting settings: tokens per step and modeled speed on the suite.

Every variant (a base `LookaheadConfig` plus `key=value` overrides) generates greedily on every prompt while the
planner plans on ONE fixed cost curve (`Lookahead(cost_curve=...)`: no correction by step timings), so the steps
it takes depend only on the drafts — the comparison is exact and repeatable on a busy machine. Per category it
reports tokens committed per step, rows verified per step and the modeled speed: tokens / the sum over steps of
the curve's cost of that step's rows (in one-row steps; what the speed over the same loop without speculation
would be if the curve held). Every variant's output is checked against the first variant's, token for token.
With `--sample` every run samples as bench_generate's sampled rows do (T=0.7, top_p=0.95), seeded: a seeded
lookahead draws the same tokens whatever it drafts, so the runs stay repeatable and comparable.

    python benchmarks/bench_drafts.py --prompts-per-category 6 --variant all --variant nopool:pool_candidates=0
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench_generate import SAMPLE_SEED, SAMPLING
from harness import (check_counts, common_parser, default_out, group_name, headed, load_target, machine_info,
                     markdown_table, parse_overrides, progress_bar, publish)
from prompts import encode, load_prompts


def parse_args(argv: list[str] | None = None):
    """Options: the suite's (model, categories, prompts, lengths, threads), `--variant NAME[:k=v,k=v]` (repeatable;
    default: the config's defaults alone), `--curve FILE` (a cost-curve JSON as `lookahead calibrate` caches it;
    default: this model's measured curve), `--fresh-table` (clear the recycling table before every prompt) and
    `--sample` (seeded sampling instead of greedy decoding), `--datastore PATH` (repeatable: a datastore every
    variant drafts from)."""
    parser = common_parser(__doc__.splitlines()[0], prompts_per_category=3, repeats=1)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME[:KEY=VALUE,...]")
    parser.add_argument("--curve", type=Path, default=None)
    parser.add_argument("--fresh-table", action="store_true")
    parser.add_argument("--sample", action="store_true", help="seeded sampling (T=0.7, top_p=0.95) instead of greedy")
    parser.add_argument("--datastore", action="append", default=[], metavar="PATH",
                        help="text file or folder every variant drafts from (lookahead.datastore); repeatable")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        check_counts(args, ("prompts_per_category", "max_new_tokens", "threads"))
        args.variants = [parse_variant(text) for text in args.variant] or [("defaults", {})]
    except ValueError as exc:
        parser.error(str(exc))
    return args


def parse_variant(text: str) -> tuple[str, dict]:
    """`"nopool:pool_candidates=0,recycle_nodes=8"` → `("nopool", {...})`; raises `ValueError` for a bad one."""
    name, _, pairs = text.partition(":")
    if not name.strip():
        raise ValueError(f"--variant needs a name, got {text!r}")
    return name.strip(), parse_overrides([p for p in pairs.split(",") if p.strip()])


def run_variants(model, tokenizer, prompts, variants, curve, max_new_tokens: int, fresh_table: bool,
                 progress: bool = True, sample: bool = False, shared=None) -> dict:
    """Generate every prompt with every variant on `curve` (greedy, or seeded sampling with `sample`; `shared`: a
    shared drafter such as a datastore, None: none); returns
    {"variants", "decoding", "runs", "summary"}. Raises `AssertionError` naming the prompt if a variant's output
    differs from the first variant's."""
    from lookahead import Lookahead, LookaheadConfig

    encoded = [encode(tokenizer, prompt) for prompt in prompts]
    bar = progress_bar(len(variants) * len(prompts), progress)
    runs, reference = [], {}
    decoding = dict(SAMPLING) if sample else {"do_sample": False}
    seeded = {"seed": SAMPLE_SEED} if sample else {}
    for name, overrides in variants:
        decoder = Lookahead(LookaheadConfig(**{**seeded, **overrides}), cost_curve=curve, shared_drafter=shared)
        for prompt, ids in zip(prompts, encoded):
            bar.set_postfix_str(f"{name} {prompt.id}")
            if fresh_table and decoder.recycle_table is not None:
                decoder.recycle_table.clear()
            out = model.generate(ids, **decoding, max_new_tokens=max_new_tokens, custom_generate=decoder)
            out = out[0, ids.shape[1]:].tolist()
            if reference.setdefault(prompt.id, out) != out:
                raise AssertionError(f"variant {name} changed the output of {prompt.id}")
            stats = decoder.last_stats
            runs.append({"variant": name, "prompt_id": prompt.id, "category": prompt.category,
                         "steps": stats.steps, "tokens": stats.step_tokens, "rows": stats.rows_verified,
                         "cost": sum(curve.ratio(n) for n in stats.step_rows),
                         "predicted": sum(p for p, _ in stats.calibration),
                         "predicted_steps": len(stats.calibration)})
            bar.update()
    bar.close()
    return {"variants": {name: overrides for name, overrides in variants}, "decoding": {**decoding, **seeded},
            "runs": runs, "summary": summarize(runs)}


def summarize(runs: list[dict]) -> dict:
    """{variant: {category or "all": {tokens_per_step, rows_per_step, modeled_speed, predicted_per_step}}}
    (predicted_per_step: the planner's mean predicted tokens over the steps it predicted)."""
    out: dict = {}
    for run in runs:
        for group in (run["category"], "all"):
            cell = out.setdefault(run["variant"], {}).setdefault(group, {"tokens": 0, "steps": 0, "rows": 0,
                                                                         "cost": 0.0, "predicted": 0.0,
                                                                         "predicted_steps": 0})
            for key in ("tokens", "steps", "rows", "cost", "predicted", "predicted_steps"):
                cell[key] += run.get(key, 0)
    for groups in out.values():
        for cell in groups.values():
            steps = max(cell["steps"], 1)
            cell.update(tokens_per_step=cell["tokens"] / steps, rows_per_step=cell["rows"] / steps,
                        modeled_speed=cell["tokens"] / cell["cost"] if cell["cost"] else 0.0,
                        predicted_per_step=cell["predicted"] / max(cell["predicted_steps"], 1))
    return out


def format_table(result: dict) -> str:
    """Markdown: one row per category (and all), one `tokens/step · modeled speed` cell per variant."""
    summary = result["summary"]
    names = list(summary)
    groups = [g for g in summary[names[0]] if g != "all"] + ["all"]
    rows = [[group_name(g)] + [f"{summary[n][g]['tokens_per_step']:.2f} · {summary[n][g]['modeled_speed']:.2f}x"
                               for n in names] for g in groups]
    return "\n".join([f"Command: `{result['command']}`", ""] + markdown_table(["category"] + names, rows))


def main(argv: list[str] | None = None) -> None:
    """Run the comparison from the command line; print the table and write the JSON."""
    args = parse_args(argv)
    from lookahead import LookaheadConfig
    from lookahead.calibration import cost_curve_for
    from lookahead.cost_curve import CostCurve
    from lookahead.datastore import build_datastore
    from lookahead.hf import generation_arithmetic

    model, tokenizer = load_target(args)
    if args.curve is not None:
        curve = CostCurve.from_json(args.curve.read_text())
    else:
        with generation_arithmetic(model, LookaheadConfig()):  # the arithmetic decides which cached curve is read
            curve = cost_curve_for(model)
    prompts = load_prompts(args.categories, args.prompts_per_category, args.prompts_dir, args.skip_prompts)
    machine = machine_info(args.threads)
    shared, report = build_datastore(args.datastore, tokenizer) if args.datastore else (None, None)
    result = run_variants(model, tokenizer, prompts, args.variants, curve, args.max_new_tokens, args.fresh_table,
                          sample=args.sample, shared=shared)
    result["datastore"] = None if report is None else report.summary()
    result["cost_curve"] = json.loads(curve.to_json())
    result = headed(result, machine, model=args.model or "SmolLM2-135M-Instruct (embedded default)")
    publish(result, default_out("drafts") if args.out is None else args.out, format_table(result))


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as exc:  # a bad override or an unreadable / malformed --curve file
        sys.exit(f"bench_drafts: {exc}")
