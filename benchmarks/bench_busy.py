"""Generation while other processes hold the cores: HF greedy and lookahead beside busy-looping processes.

    python benchmarks/bench_busy.py [--busy 1] [--categories code chat] [--prompts-per-category 1]
        [--max-new-tokens 48] [--repeats 1] [--threads 2] [--out FILE.json]

`--busy N` starts N processes that spin on the CPU for the whole run (0: an idle machine, the reference). Per prompt
and repetition, interleaved: HF greedy on `--threads` threads and on one thread, lookahead with its thread governor
(`lookahead/thread_governor.py`, the default) and lookahead on a fixed thread count (`adapt_threads=False`). Every
output is compared with HF greedy's, token for token; `fewer_threads_steps` counts the steps the governor ran on fewer
threads.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from harness import (ForwardCounter, close_load_average, common_parser, cpu_flags, default_out, headed,
                     machine_info, markdown_table, progress_bar, publish, timed_run)
from prompts import encode, load_prompts

METHODS = ("hf_greedy", "hf_greedy_one_thread", "lookahead_fixed_threads", "lookahead")


def main(argv: list[str] | None = None) -> None:
    """Load the default model, start the busy processes, run every method per prompt, print the table, write JSON."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import lookahead

    machine = machine_info(args.threads)
    model, tokenizer = lookahead.load_model()
    prompts = load_prompts(args.categories, args.prompts_per_category, args.prompts_dir, args.skip_prompts)
    warm_up(model, tokenizer, prompts[0], lookahead)
    with busy_processes(args.busy):
        runs = run_prompts(model, tokenizer, prompts, args, lookahead)
    close_load_average(machine)
    result = headed({"busy_processes": args.busy, "cpu_flags": cpu_flags(), "runs": runs, "summary": summarize(runs)},
                    machine, model="SmolLM2-135M-Instruct (embedded)")
    publish(result, args.out or default_out(f"busy{args.busy}"), format_table(result))


def warm_up(model, tokenizer, prompt, lookahead) -> None:
    """One untimed call of each kind on the idle machine (cost curve, kernel choice, layouts)."""
    ids = encode(tokenizer, prompt)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                   custom_generate=lookahead.Lookahead())


@contextlib.contextmanager
def busy_processes(count: int):
    """`count` processes spinning on the CPU while the block runs (yielded; killed after it, whatever happens)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def run_prompts(model, tokenizer, prompts, args, lookahead) -> list[dict]:
    """Per prompt and repetition, every method in a rotated order, timed by the harness's `timed_run`."""
    runs, bar = [], progress_bar(len(prompts) * args.repeats * len(METHODS))
    with ForwardCounter(model) as counter:
        for i, prompt in enumerate(prompts):
            ids = encode(tokenizer, prompt)
            for r in range(args.repeats):
                shift = (i + r) % len(METHODS)
                outputs = {}
                for method in METHODS[shift:] + METHODS[:shift]:
                    bar.set_postfix_str(f"{prompt.category} {method}")
                    outputs[method] = run_method(model, ids, method, args, counter, lookahead)
                    bar.update()
                reference = outputs["hf_greedy"]["tokens"]
                runs.append({"category": prompt.category, "repeat": r,
                             "identical": all(o.pop("tokens") == reference for o in list(outputs.values())),
                             **outputs})
    bar.close()
    return runs


def run_method(model, ids, method: str, args, counter, lookahead) -> dict:
    """One timed generation by `method` (see METHODS); lookahead's runs add the steps its governor ran on fewer
    threads."""
    if method == "hf_greedy_one_thread":
        torch.set_num_threads(1)
        try:
            return timed_run(model, ids, method, args.max_new_tokens, counter, do_sample=False)
        finally:
            torch.set_num_threads(args.threads)
    if method == "hf_greedy":
        return timed_run(model, ids, method, args.max_new_tokens, counter, do_sample=False)
    decoder = lookahead.Lookahead(adapt_threads=method == "lookahead")
    run = timed_run(model, ids, method, args.max_new_tokens, counter, do_sample=False, custom_generate=decoder)
    run["fewer_threads_steps"] = decoder.last_stats.fewer_threads_steps
    return run


def summarize(runs: list[dict]) -> dict:
    """Per method: median seconds and tokens/s over the runs, speedup vs HF greedy (median of per-run ratios)."""
    summary = {}
    for method in METHODS:
        timed = [r[method] for r in runs]
        summary[method] = {"seconds": statistics.median(t["seconds"] for t in timed),
                           "tokens_per_second": statistics.median(t["tokens_per_second"] for t in timed),
                           "speedup_vs_hf_greedy": statistics.median(r["hf_greedy"]["seconds"] / r[method]["seconds"]
                                                                     for r in runs),
                           "tokens_per_step": statistics.median(t["tokens_per_step"] for t in timed),
                           "fewer_threads_steps": sum(t.get("fewer_threads_steps", 0) for t in timed)}
    summary["identical"] = f"{sum(r['identical'] for r in runs)}/{len(runs)}"
    return summary


def format_table(result: dict) -> str:
    """Markdown: the machine and busy processes, then one row per method."""
    machine, summary = result["machine"], result["summary"]
    head = (f"CPU flags: {' '.join(result['cpu_flags'])}; {machine['cpu']}, {machine['cpu_count']} cores, "
            f"{machine['threads']} threads; {result['busy_processes']} busy processes; outputs identical to HF greedy: "
            f"{summary['identical']}\n\nCommand: `{result['command']}`\n")
    rows = [[method, f"{s['seconds']:.2f}", f"{s['tokens_per_second']:.1f}", f"{s['speedup_vs_hf_greedy']:.2f}x",
             f"{s['tokens_per_step']:.2f}", str(s["fewer_threads_steps"])]
            for method, s in summary.items() if method != "identical"]
    header = ["method", "seconds", "tok/s", "× HF greedy", "tokens/step", "steps on fewer threads"]
    return head + "\n" + "\n".join(markdown_table(header, rows))


def parse_args(argv: list[str] | None):
    """Command-line options (see the module docstring)."""
    parser = common_parser(__doc__.splitlines()[0], prompts_per_category=1, repeats=1,
                           categories=("code", "chat"), model=False)
    parser.add_argument("--busy", type=int, default=1, help="processes spinning on the CPU during the run")
    parser.add_argument("--out", type=Path, default=None)
    parser.set_defaults(max_new_tokens=48)
    args = parser.parse_args(argv)
    if min(args.prompts_per_category, args.repeats, args.max_new_tokens, args.threads) < 1 or args.busy < 0:
        parser.error("counts must be at least 1 (--busy at least 0)")
    return args


if __name__ == "__main__":
    main()
