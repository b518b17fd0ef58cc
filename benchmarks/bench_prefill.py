"""Long prompts, short answers: requests whose time is mostly the prompt's prefill, against plain HF greedy.

    python benchmarks/bench_prefill.py [--lengths 660 1500 3000] [--max-new-tokens 16] [--repeats 3]
        [--threads 2] [--out FILE.json]

A code-completion backend or a retrieval pipeline sends long prompts for short answers, so a request's time is
mostly the prompt's prefill. Each prompt here is the suite's retrieval and summarization prompts (data/prompts)
concatenated, cut to each of `--lengths` tokens; for each, plain HF greedy (`model.generate`) and lookahead
(`custom_generate=Lookahead()`, default configuration) generate `--max-new-tokens` tokens, alternating within each
repetition (after one untimed warm-up of each). The table shows medians over the repetitions: HF's whole call,
lookahead's whole call and its prefill (`last_stats.prefill_time`: the prompt's forward and the first token), its
tokens a second after the prefill (the other new tokens over the rest of the call: decoding over a long cache,
what a longer `--max-new-tokens` shows), the speedup of the whole call, and whether every output equals HF's token
for token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from harness import close_load_average, default_out, headed, load_target, machine_info, markdown_table, publish
from prompts import DEFAULT_PROMPTS_DIR, encode, load_prompts

SOURCES = ("rag", "summarization")  # the suite's long prompts, concatenated into the long ones
PER_SOURCE = 4


def main(argv: list[str] | None = None) -> None:
    """Time each length's HF and lookahead calls, print the table and write the JSON."""
    args = parse_args(argv)
    model, tokenizer = load_target(args)
    text = torch.cat([encode(tokenizer, p) for p in load_prompts(SOURCES, PER_SOURCE, args.prompts_dir)], dim=1)
    if text.shape[1] < max(args.lengths):
        raise SystemExit(f"error: the prompts hold {text.shape[1]} tokens, fewer than --lengths asks")
    machine = machine_info(args.threads)
    rows = [measure(model, text[:, :length], args.max_new_tokens, args.repeats) for length in args.lengths]
    close_load_average(machine)
    result = headed({"settings": settings(args), "rows": rows}, machine, model=args.model or "default")
    publish(result, args.out or default_out("prefill"), table(rows))


def measure(model, ids: torch.Tensor, max_new_tokens: int, repeats: int) -> dict:
    """One prompt ids [1, L]: HF greedy's and lookahead's calls alternated `repeats` times after a warm-up of each;
    their medians (whole calls, lookahead's prefill), the speedup and whether every output was HF's."""
    from lookahead import Lookahead

    runs = {"hf": [], "lookahead": [], "prefill": []}
    identical, new_tokens = True, 0
    for repeat in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=max_new_tokens)
        t1 = time.perf_counter()
        decoder = Lookahead()
        fast = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_new_tokens, custom_generate=decoder)
        t2 = time.perf_counter()
        identical &= torch.equal(plain, fast)
        new_tokens = fast.shape[1] - ids.shape[1]
        if repeat:
            runs["hf"].append(t1 - t0)
            runs["lookahead"].append(t2 - t1)
            runs["prefill"].append(decoder.last_stats.prefill_time)
        print(f"{ids.shape[1]} tokens, repetition {repeat}: HF {t1 - t0:.2f} s, lookahead {t2 - t1:.2f} s",
              file=sys.stderr)
    medians = {name: statistics.median(times) for name, times in runs.items()}
    after = medians["lookahead"] - medians["prefill"]  # the prefill's time holds the first token
    return {"prompt_tokens": ids.shape[1], **{f"{name}_s": value for name, value in medians.items()},
            "speedup": medians["hf"] / medians["lookahead"], "new_tokens": new_tokens,
            "decode_tokens_per_s": (new_tokens - 1) / after if after > 0 else None, "identical": identical,
            "runs": runs}


def settings(args: argparse.Namespace) -> dict:
    """The command line's values as JSON values (paths as strings)."""
    return {name: str(value) if isinstance(value, Path) else value for name, value in vars(args).items()}


def table(rows: list[dict]) -> str:
    """The markdown table of the measured lengths."""
    header = ["prompt tokens", "HF greedy s", "lookahead s", "its prefill s", "its tok/s after the prefill",
              "× HF greedy", "identical"]
    return "\n".join(markdown_table(header, [[str(r["prompt_tokens"]), f"{r['hf_s']:.2f}", f"{r['lookahead_s']:.2f}",
                                              f"{r['prefill_s']:.2f}", _rate(r.get("decode_tokens_per_s")),
                                              f"{r['speedup']:.2f}x", "yes" if r["identical"] else "NO"]
                                             for r in rows]))


def _rate(tokens_per_s: float | None) -> str:
    """A rate for the table: one decimal, or a dash where nothing followed the prefill."""
    return "—" if tokens_per_s is None else f"{tokens_per_s:.1f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; counts below 1 are refused with a one-line error."""
    parser = argparse.ArgumentParser(description="Long prompts, short answers: lookahead against plain HF greedy")
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[660, 1500, 3000], help="prompt tokens")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts-dir", type=Path, default=DEFAULT_PROMPTS_DIR)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if min(args.lengths) < 1:
        parser.error(f"--lengths must be at least 1, got {min(args.lengths)}")
    return args


if __name__ == "__main__":
    main()
