"""lookahead on a model whose layers are partly offloaded to disk (accelerate `device_map` + `offload_folder`).

    python benchmarks/bench_offload.py [--disk-layers 15] [--categories code summarization] [--prompts-per-category 1]
        [--max-new-tokens 64] [--repeats 1] [--threads 2] [--out FILE.json]

The default model is loaded with its last `--disk-layers` decoder layers (and nothing else) on "disk": accelerate
writes their weights to an offload folder and reads them back in at every forward, so every step pays for
streaming those weights whatever its row count. That is the regime speculation was made for: verifying k rows
costs about one row, so the speedup should approach the tokens committed per step. Per prompt, HF greedy and
lookahead run interleaved on the same offloaded model; outputs are compared token for token, and the one-row and
16-row forward times of the offloaded model are measured alongside (the step-cost ratio this regime has).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch

from harness import (ForwardCounter, close_load_average, common_parser, cpu_flags, default_out, headed,
                     machine_info, markdown_table, progress_bar, publish, timed_run)
from prompts import encode, load_prompts


def main(argv: list[str] | None = None) -> None:
    """Load the offloaded model, run both methods per prompt, print the table, write JSON."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import lookahead

    machine = machine_info(args.threads)
    with tempfile.TemporaryDirectory(prefix="lookahead-offload-") as folder:
        model, tokenizer = load_offloaded(args.disk_layers, folder)
        prompts = load_prompts(args.categories, args.prompts_per_category, args.prompts_dir, args.skip_prompts)
        runs = run_prompts(model, tokenizer, prompts, args.max_new_tokens, args.repeats, lookahead)
        step = step_ratio(model)
    close_load_average(machine)
    result = headed({"disk_layers": args.disk_layers, "cpu_flags": cpu_flags(), "step_cost": step,
                     "runs": runs, "summary": summarize(runs)}, machine, model="SmolLM2-135M-Instruct (embedded)")
    publish(result, args.out or default_out("offload"), format_table(result))


def load_offloaded(disk_layers: int, folder: str):
    """The default model with its last `disk_layers` decoder layers on disk (offloaded into `folder`)."""
    from transformers import AutoConfig

    from lookahead.models import default_model_folder, load_model

    layers = AutoConfig.from_pretrained(default_model_folder()).num_hidden_layers
    if not 0 < disk_layers <= layers:
        sys.exit(f"--disk-layers must be within 1..{layers}")
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "disk" if i >= layers - disk_layers else "cpu" for i in range(layers)})
    return load_model(None, device_map=device_map, offload_folder=folder)


def run_prompts(model, tokenizer, prompts, max_new_tokens: int, repeats: int, lookahead) -> list[dict]:
    """Per prompt and repetition: HF greedy then lookahead (alternating which goes first), timed by the
    harness's `timed_run` (tokens per step from counted target forwards), after one untimed warm-up call."""
    runs, bar = [], progress_bar(len(prompts) * repeats * 2)
    warm_up = encode(tokenizer, prompts[0])  # the first lookahead call measures the split model's cost curve
    model.generate(warm_up, attention_mask=torch.ones_like(warm_up), max_new_tokens=4, do_sample=False,
                   custom_generate=lookahead.Lookahead())
    with ForwardCounter(model) as counter:
        for i, prompt in enumerate(prompts):
            ids = encode(tokenizer, prompt)
            for r in range(repeats):
                order = ("hf_greedy", "lookahead") if (i + r) % 2 == 0 else ("lookahead", "hf_greedy")
                outputs = {}
                for method in order:
                    bar.set_postfix_str(f"{prompt.category} {method}")
                    extra = {"custom_generate": lookahead.Lookahead()} if method == "lookahead" else {}
                    outputs[method] = timed_run(model, ids, method, max_new_tokens, counter, do_sample=False,
                                                **extra)
                    bar.update()
                same = outputs["hf_greedy"].pop("tokens") == outputs["lookahead"].pop("tokens")
                runs.append({"category": prompt.category, "repeat": r, "identical": same, **outputs})
    bar.close()
    return runs


def step_ratio(model, prefix: int = 256, repeats: int = 3) -> dict:
    """Seconds of one forward of 1 and of 16 rows on a `prefix`-token cache and their ratio, measured as lookahead
    measures its cost curve (`calibration.measure_cost_curve`: interleaved, lower quartile)."""
    from lookahead.calibration import measure_cost_curve

    curve = measure_cost_curve(model, sizes=(1, 16), prefixes=(prefix,), repeats=repeats)
    return {"one_row_s": curve.base_seconds, "sixteen_rows_s": curve.base_seconds * curve.ratio(16),
            "ratio_16": curve.ratio(16)}


def summarize(runs: list[dict]) -> dict:
    """Per category and overall: median tokens/s of each method, speedup, tokens/step, identical count."""
    groups = {}
    for run in runs:
        groups.setdefault(run["category"], []).append(run)
    groups["all"] = runs
    return {key: {"runs": len(group), "identical": sum(r["identical"] for r in group),
                  "hf_greedy_tok_s": statistics.median(r["hf_greedy"]["tokens_per_second"] for r in group),
                  "lookahead_tok_s": statistics.median(r["lookahead"]["tokens_per_second"] for r in group),
                  "speedup": statistics.median(r["hf_greedy"]["seconds"] / r["lookahead"]["seconds"] for r in group),
                  "tokens_per_step": statistics.median(r["lookahead"]["tokens_per_step"] for r in group)}
            for key, group in groups.items()}


def format_table(result: dict) -> str:
    """Markdown: the machine, the step-cost ratio of the offloaded model, and the per-category table."""
    step = result["step_cost"]
    head = (f"CPU flags: {' '.join(result['cpu_flags'])}; {result['machine']['cpu']}, {result['machine']['threads']} "
            f"threads; {result['disk_layers']} decoder layers on disk\n\nOffloaded forward: one row "
            f"{step['one_row_s'] * 1e3:.0f} ms, 16 rows {step['sixteen_rows_s'] * 1e3:.0f} ms "
            f"({step['ratio_16']:.2f}x)\n\nCommand: `{result['command']}`\n")
    rows = [[key, str(s["runs"]), f"{s['hf_greedy_tok_s']:.1f}", f"{s['lookahead_tok_s']:.1f}", f"{s['speedup']:.2f}x",
             f"{s['tokens_per_step']:.2f}", f"{s['identical']}/{s['runs']}"] for key, s in result["summary"].items()]
    header = ["category", "runs", "HF greedy tok/s", "lookahead tok/s", "× HF greedy", "tokens/step", "identical"]
    return head + "\n" + "\n".join(markdown_table(header, rows))


def parse_args(argv: list[str] | None):
    """Command-line options (see the module docstring)."""
    parser = common_parser(__doc__.splitlines()[0], prompts_per_category=1, repeats=1,
                           categories=("code", "summarization"), model=False)
    parser.add_argument("--disk-layers", type=int, default=15, help="decoder layers offloaded to disk")
    parser.add_argument("--out", type=Path, default=None)
    parser.set_defaults(max_new_tokens=64)
    args = parser.parse_args(argv)
    if min(args.prompts_per_category, args.repeats, args.max_new_tokens, args.threads) < 1:
        parser.error("counts must be at least 1")
    return args


if __name__ == "__main__":
    main()
