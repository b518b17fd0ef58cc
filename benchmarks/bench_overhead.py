"""Per-step overhead of lookahead: drafting + trie + mask building and verification vs the target forward.

    python benchmarks/bench_overhead.py [--model PATH] [--categories code chat ...] [--prompts-per-category 2]
        [--max-new-tokens 128] [--repeats 1] [--threads 2] [--config key=value ...] [--out PATH.json]

For every prompt it runs lookahead and reads `Lookahead.last_stats`: `draft_time` (drafting, trie, layout and
mask), `forward_time` (the target forwards) and `verify_time` (verification, cache compaction, drafter and
window updates), per decoding step. It also runs plain HF greedy on the same prompt and times each of its decode
forwards (hooks around `model.forward`, the prefill excluded), which gives the cost of one plain step. Issue 5
asks drafting + trie + mask to stay within 10% of step time (`draft share`); `step cost` is a lookahead step in
plain steps, i.e. the tokens per step a step must commit to break even.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from harness import (common_parser, finish_args, group_name, load_target, machine_info, markdown_table, progress_bar,
                     write_json)
from prompts import encode

DEFAULT_CATEGORIES = ("code", "summarization", "chat")  # copying-friendly, grounded, free text


class ForwardTimer:
    """Records the wall time of every `model.forward` call while active; a context manager."""

    def __init__(self, model):
        self.model, self.times, self._start, self._handles = model, [], 0.0, []

    def __enter__(self) -> "ForwardTimer":
        self._handles = [self.model.register_forward_pre_hook(self._before),
                         self.model.register_forward_hook(self._after)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _before(self, module, args) -> None:
        self._start = time.perf_counter()

    def _after(self, module, args, output) -> None:
        self.times.append(time.perf_counter() - self._start)


def measure_prompt(model, input_ids: torch.Tensor, decoder, max_new_tokens: int) -> dict:
    """Run lookahead and plain greedy once on `input_ids` ([1, L]); returns lookahead's `DecodeStats` fields and
    `greedy_step_s`, the median time of one plain decode forward (prefill excluded)."""
    with ForwardTimer(model) as timer:
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                       do_sample=False)
    model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                   do_sample=False, custom_generate=decoder)
    decode_forwards = timer.times[1:] or timer.times
    return {**decoder.last_stats.as_dict(), "greedy_step_s": statistics.median(decode_forwards)}


def summarize(measurements: list[dict]) -> dict:
    """Per-step milliseconds, shares and step cost over a group of measurements (pooled over their steps)."""
    steps = sum(m["steps"] for m in measurements) or 1
    draft, forward, verify = (sum(m[key] for m in measurements) for key in
                              ("draft_time", "forward_time", "verify_time"))
    step = (draft + forward + verify) / steps
    greedy = statistics.median(m["greedy_step_s"] for m in measurements)
    return {
        "runs": len(measurements), "steps": steps,
        "rows_per_step": sum(m["rows_verified"] for m in measurements) / steps,
        "tokens_per_step": sum(m["step_tokens"] for m in measurements) / steps,
        "draft_ms": 1e3 * draft / steps, "forward_ms": 1e3 * forward / steps, "verify_ms": 1e3 * verify / steps,
        "draft_share": draft / (step * steps), "overhead_share": (draft + verify) / (step * steps),
        "greedy_step_ms": 1e3 * greedy, "step_cost": step / greedy,
    }


def format_table(summary: dict) -> str:
    """Markdown table, one row per category plus "all"."""
    header = ["category", "steps", "rows/step", "tokens/step", "draft ms", "forward ms", "verify ms",
              "draft share", "draft+verify share", "greedy step ms", "step cost (× greedy)"]
    rows = [[group_name(group), str(s["steps"]), f"{s['rows_per_step']:.1f}", f"{s['tokens_per_step']:.2f}",
             f"{s['draft_ms']:.2f}", f"{s['forward_ms']:.1f}", f"{s['verify_ms']:.2f}", f"{s['draft_share']:.2%}",
             f"{s['overhead_share']:.2%}", f"{s['greedy_step_ms']:.1f}", f"{s['step_cost']:.2f}"]
            for group, s in summary.items()]
    return "\n".join(markdown_table(header, rows)) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = common_parser(__doc__.splitlines()[0], prompts_per_category=2, repeats=1,
                           categories=DEFAULT_CATEGORIES)
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="LookaheadConfig override (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="also write the measurements as JSON")
    args = parser.parse_args(argv)
    return finish_args(parser, args, ("prompts_per_category", "max_new_tokens", "repeats", "threads"))


def main(argv: list[str] | None = None) -> None:
    """Measure, print the markdown table, optionally write JSON."""
    args = parse_args(argv)
    from lookahead import Lookahead

    model, tokenizer = load_target(args)
    decoder = Lookahead(args.lookahead_config)
    encoded = [encode(tokenizer, prompt) for prompt in args.prompts]
    measure_prompt(model, encoded[0], decoder, args.max_new_tokens)  # warm-up (numba JIT, caches)
    measurements, bar = [], progress_bar(args.repeats * len(encoded))
    for _ in range(args.repeats):
        for prompt, input_ids in zip(args.prompts, encoded):
            bar.set_postfix_str(prompt.id)
            measured = measure_prompt(model, input_ids, decoder, args.max_new_tokens)
            measurements.append({"prompt_id": prompt.id, "category": prompt.category, **measured})
            bar.update()
    bar.close()
    groups = list(dict.fromkeys(m["category"] for m in measurements))
    summary = {g: summarize([m for m in measurements if m["category"] == g]) for g in groups}
    summary["all"] = summarize(measurements)
    print(format_table(summary))
    if args.out:
        write_json({"machine": machine_info(args.threads), "config": args.lookahead_config.as_dict(),
                    "max_new_tokens": args.max_new_tokens, "measurements": measurements, "summary": summary},
                   args.out)
        print(f"results: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
