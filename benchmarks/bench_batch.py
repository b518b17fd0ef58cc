"""Batch throughput: plain batched HF greedy vs batched lookahead at several batch sizes, same prompts.

    python benchmarks/bench_batch.py [--model PATH] [--categories code rag ...] [--prompts-per-category 2]
        [--batch-sizes 1 2 4 8] [--max-new-tokens 64] [--repeats 1] [--threads 2] [--config KEY=VALUE ...]
        [--sample] [--busy N] [--out benchmarks/results/NAME.json]

Every batch size decodes the same prompts (the first `max(batch sizes)` of the selection, left-padded in groups
of the batch size), so throughputs compare directly. Within a repetition each group runs both methods back to
back in an order rotated from group to group. Throughput counts generated tokens up to each sequence's EOS (the
pad fill after it is not counted). Every lookahead output is compared with plain batched greedy, sequence by
sequence. `--sample` runs HF's batched sampling against seeded lookahead sampling instead (the speed suite's
settings: T=0.7, top_p=0.95); sampled outputs legitimately differ, so they are not compared. `--busy N` runs the
timed repetitions beside N processes spinning on the CPU (the warm-up, which measures the cost curves, runs before
they start); `--config adapt_threads=false` is lookahead without its thread governor.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from bench_busy import busy_processes
from bench_generate import SAMPLE_SEED, SAMPLING  # the speed suite's sampling settings
from harness import (common_parser, default_out, finish_args, headed, load_target, machine_info, progress_bar, publish,
                     rotated)
from prompts import encode

METHODS = ("hf_greedy", "lookahead")
SAMPLED_METHODS = ("hf_sample", "lookahead_sample")


def left_pad(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] left-padded ids and attention mask from 1-D id tensors (L: the longest prompt's length)."""
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        ids[b, length - len(prompt):], mask[b, length - len(prompt):] = prompt, 1
    return ids, mask


def generated_tokens(output: torch.Tensor, prompt_length: int, eos: set[int]) -> int:
    """Tokens generated over all sequences of `output` [B, L + new] (L = `prompt_length`), each counted up to its
    first EOS."""
    total = 0
    for new in output[:, prompt_length:].tolist():
        ends = [i for i, token in enumerate(new) if token in eos]
        total += ends[0] + 1 if ends else len(new)
    return total


def run_batches(model, tokenizer, prompts, batch_sizes: list[int], repeats: int, max_new_tokens: int,
                config, progress: bool = True, sample: bool = False, during=contextlib.nullcontext) -> dict:
    """Run both methods (greedy, or sampled with `sample`) on every group of every batch size, `repeats` times,
    the timed runs inside the context `during()` (after the warm-up); returns runs and a summary."""
    from lookahead import Lookahead

    methods = SAMPLED_METHODS if sample else METHODS
    encoded = [encode(tokenizer, p)[0] for p in prompts[: max(batch_sizes)]]
    eos = set(_as_list(model.generation_config.eos_token_id))
    pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, *sorted(eos)) if t is not None), 0)
    groups = [(size, encoded[i: i + size]) for size in batch_sizes for i in range(0, len(encoded), size)]
    decoder, runs = Lookahead(config.with_overrides(seed=SAMPLE_SEED) if sample else config), []
    bar = progress_bar((repeats * len(groups) + len(batch_sizes)) * len(methods), progress)
    for size in batch_sizes:  # warm-up per batch size (this also measures lookahead's cost curve for it)
        for method in methods:
            bar.set_postfix_str(f"warm-up batch {size} {method}")
            _generate(model, *left_pad(encoded[:size], pad), method, decoder, 8, pad)
            bar.update()
    with during():
        _timed_groups(model, groups, methods, decoder, repeats, max_new_tokens, pad, eos, bar, runs)
    bar.close()
    return {"settings": {"batch_sizes": batch_sizes, "repeats": repeats, "max_new_tokens": max_new_tokens,
                         "prompts": [p.id for p in prompts[: max(batch_sizes)]],
                         "lookahead_config": config.as_dict(), "methods": list(methods),
                         "sampling": {**SAMPLING, "lookahead_seed": SAMPLE_SEED} if sample else None},
            "runs": runs, "summary": summarize(runs, batch_sizes, methods)}


def _timed_groups(model, groups, methods, decoder, repeats: int, max_new_tokens: int, pad: int, eos: set[int], bar,
                  runs: list[dict]) -> None:
    """The timed repetitions of `run_batches`: each group with each method, order rotated; appends to `runs`."""
    sample = methods == SAMPLED_METHODS
    for repeat in range(repeats):
        for index, (size, prompts_of_group) in enumerate(groups):
            ids, mask = left_pad(prompts_of_group, pad)
            outputs = {}
            for method in rotated(list(methods), repeat + index):
                bar.set_postfix_str(f"batch {size} {method}")
                start = time.perf_counter()
                outputs[method] = _generate(model, ids, mask, method, decoder, max_new_tokens, pad)
                runs.append({"batch_size": size, "repeat": repeat, "group": index, "method": method,
                             "seconds": time.perf_counter() - start,
                             "tokens": generated_tokens(outputs[method], ids.shape[1], eos),
                             "tokens_per_step": decoder.last_stats.mean_tokens_per_step
                             if method.startswith("lookahead") else 1.0,
                             "fewer_threads_steps": decoder.last_stats.fewer_threads_steps
                             if method.startswith("lookahead") else 0})
                bar.update()
            runs[-1]["identical"] = runs[-2]["identical"] = None if sample else bool(torch.equal(*outputs.values()))


def _generate(model, ids, mask, method: str, decoder, max_new_tokens: int, pad: int) -> torch.Tensor:
    """One batched generate with `method` (greedy, or sampled for the `*_sample` methods)."""
    extra = {"custom_generate": decoder} if method.startswith("lookahead") else {}
    sampling = SAMPLING if method.endswith("_sample") else {"do_sample": False}
    return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad, **sampling,
                          **extra)


def _as_list(value) -> list[int]:
    """An int, a list or None as a list."""
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def summarize(runs: list[dict], batch_sizes: list[int], methods: tuple[str, str] = METHODS) -> dict:
    """Per batch size and method (`methods`: HF's, then lookahead's): tokens/s (total tokens / total seconds),
    tokens per step (lookahead), and the identical-output count; plus lookahead's `speedup` over HF's."""
    out = {}
    for size in batch_sizes:
        entry = {}
        for method in methods:
            mine = [r for r in runs if r["batch_size"] == size and r["method"] == method]
            seconds = sum(r["seconds"] for r in mine)
            entry[method] = {"tokens_per_second": sum(r["tokens"] for r in mine) / seconds if seconds else 0.0,
                             "tokens_per_step": sum(r["tokens_per_step"] for r in mine) / max(len(mine), 1),
                             "identical": sum(bool(r.get("identical")) for r in mine), "runs": len(mine),
                             "fewer_threads_steps": sum(r.get("fewer_threads_steps", 0) for r in mine)}
        base = entry[methods[0]]["tokens_per_second"]
        entry["speedup"] = entry[methods[1]]["tokens_per_second"] / base if base else 0.0
        out[str(size)] = entry
    return out


def format_table(result: dict) -> str:
    """Markdown table: one row per batch size (sampled runs: no identity column)."""
    hf, ours_name = result["settings"].get("methods", METHODS)
    sampled = hf == "hf_sample"
    label = "HF sampling" if sampled else "HF greedy"
    busy = f"; beside {result['busy_processes']} busy processes" if result.get("busy_processes") else ""
    lines = [f"Command: `{result['command']}`{busy}", "",
             f"| batch | {label} tok/s | lookahead tok/s | speedup | tokens/step per sequence | "
             "steps on fewer threads |"
             + ("" if sampled else " identical |"), "|---:|---:|---:|---:|---:|---:|" + ("" if sampled else "---:|")]
    for size, entry in result["summary"].items():
        ours = entry[ours_name]
        lines.append(f"| {size} | {entry[hf]['tokens_per_second']:.1f} | {ours['tokens_per_second']:.1f} | "
                     f"{entry['speedup']:.2f}x | {ours['tokens_per_step']:.2f} | "
                     f"{ours.get('fewer_threads_steps', 0)} |"
                     + ("" if sampled else f" {ours['identical']}/{ours['runs']} |"))
    return "\n".join(lines)


def parse_args(argv: list[str] | None):
    """Command-line options (see the module docstring)."""
    parser = common_parser(__doc__.splitlines()[0], prompts_per_category=2, repeats=1)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="LookaheadConfig override (repeatable)")
    parser.add_argument("--sample", action="store_true",
                        help="HF sampling vs seeded lookahead sampling (T=0.7, top_p=0.95) instead of greedy")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU during the timed runs")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/<time>.json)")
    parser.set_defaults(max_new_tokens=64)
    args = finish_args(parser, parser.parse_args(argv), ("prompts_per_category", "max_new_tokens", "repeats",
                                                          "threads"))
    if args.busy < 0:
        parser.error(f"--busy must be at least 0, got {args.busy}")
    if any(size < 1 for size in args.batch_sizes):
        parser.error(f"--batch-sizes must be at least 1, got {args.batch_sizes}")
    if len(args.prompts) < max(args.batch_sizes):
        parser.error(f"the largest batch needs {max(args.batch_sizes)} prompts but the selection has "
                     f"{len(args.prompts)}; raise --prompts-per-category or add --categories")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run from the command line; print the table and write the JSON."""
    args = parse_args(argv)
    model, tokenizer = load_target(args)
    result = run_batches(model, tokenizer, args.prompts, args.batch_sizes, args.repeats, args.max_new_tokens,
                         args.lookahead_config, sample=args.sample, during=lambda: busy_processes(args.busy))
    result["busy_processes"] = args.busy
    result = headed(result, machine_info(args.threads),
                    model=args.model or "SmolLM2-135M-Instruct (embedded default)")
    publish(result, args.out or default_out("batch"), format_table(result))


if __name__ == "__main__":
    main()
