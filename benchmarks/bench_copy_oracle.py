"""How many tokens per step copying from the context could commit at best: an upper bound for the suite's text.

Prompt lookup and the n-gram pool draft by copying what followed an earlier occurrence of the current suffix in
the prompt and the output so far. This script replays the greedy outputs of a `bench_generate.py` result (its
`hf_greedy` runs, the reference every method reproduces) with an oracle copier: at every step it knows which
earlier occurrence of the root token (or of the last `--min-match` tokens) continues the output furthest, and
commits that many tokens plus the step's own one (at most `--max-copy` copied tokens per step). No drafter that
copies from the context can commit more per step on this text; the recycled top-k and a draft model can.

Per category it prints the oracle's tokens per step beside lookahead's measured ones, and the speed over HF greedy
that the oracle's tokens per step would give if every step cost a one-row step of lookahead's own loop (measured
by its `lookahead_off` runs) after lookahead's measured prefill: a ceiling that includes the prompt's prefill,
which no decoding speed-up shortens.

    python benchmarks/bench_copy_oracle.py benchmarks/results/smollm2-cpu-amx-streamed-run2.json [--max-copy 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from harness import REFERENCE, decode_seconds_per_token, load_target, markdown_table
from prompts import DEFAULT_PROMPTS_DIR, Prompt, encode, prompt_index


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options: the result JSON, `--min-match` (suffix tokens an occurrence must share with the root's text),
    `--max-copy` (copied tokens per step at most), `--model` (the tokenizer's model; default the embedded one)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="a bench_generate.py result JSON with hf_greedy runs")
    parser.add_argument("--min-match", type=int, default=1)
    parser.add_argument("--max-copy", type=int, default=8)
    parser.add_argument("--model", default=None, help="the model whose tokenizer encoded the prompts")
    parser.add_argument("--prompts-dir", type=Path, default=DEFAULT_PROMPTS_DIR)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.min_match < 1 or args.max_copy < 1:
        parser.error("--min-match and --max-copy must be >= 1")
    if not args.result.is_file():
        parser.error(f"no such result file: {args.result}")
    return args


def oracle_steps(text: np.ndarray, start: int, min_match: int, max_copy: int) -> int:
    """Steps an oracle copier needs to commit `text[start + 1:]` when `text[:start + 1]` is known (the prompt and
    the prefill's token): each step commits one token plus the longest continuation (at most `max_copy`) that
    follows an earlier occurrence of the current last `min_match` tokens in the known text."""
    steps, pos = 0, start
    while pos < len(text) - 1:
        pos += 1 + best_copy(text, pos, min_match, max_copy)
        steps += 1
    return steps


def best_copy(text: np.ndarray, pos: int, min_match: int, max_copy: int) -> int:
    """The most tokens after `pos` that some earlier occurrence (ending before `pos`, sharing the last `min_match`
    tokens up to `pos`) predicts right, copying only text known at `pos` (at most `max_copy`)."""
    suffix = text[pos - min_match + 1: pos + 1]
    if len(suffix) < min_match:
        return 0
    ends = np.flatnonzero(text[:pos] == text[pos])
    best = 0
    for end in ends[ends >= min_match - 1].tolist():
        if not np.array_equal(text[end - min_match + 1: end + 1], suffix):
            continue
        copied = 0
        while (copied < max_copy and end + 1 + copied <= pos and pos + 1 + copied < len(text)
               and text[end + 1 + copied] == text[pos + 1 + copied]):
            copied += 1
        best = max(best, copied)
    return best


def measure(result: dict, prompts: dict[str, Prompt], tokenizer, min_match: int, max_copy: int) -> dict:
    """{category: {"tokens", "steps", "lookahead_tokens_per_step", "ceiling"}} plus an "all" row (see the module
    docstring) for the prompts the result ran (`prompts`: by id), outputs from its first `hf_greedy` run of each.
    Raises `ValueError` if a prompt does not encode to the length the run recorded."""
    runs = result["runs"]
    outputs = {run["prompt_id"]: run["tokens"] for run in runs if run["method"] == REFERENCE and run["repeat"] == 0}
    out: dict[str, dict] = {}
    for record in result["prompts"]:
        prompt = prompts[record["id"]]
        ids = encode(tokenizer, prompt)[0].numpy()
        if len(ids) != record["prompt_tokens"]:
            raise ValueError(f"{prompt.id} encodes to {len(ids)} tokens, the run had {record['prompt_tokens']}: "
                             "not the prompts or tokenizer of that run")
        generated = np.asarray(outputs[prompt.id], dtype=np.int64)
        text = np.concatenate([ids, generated])
        steps = oracle_steps(text, len(ids), min_match, max_copy)
        for group in (prompt.category, "all"):
            entry = out.setdefault(group, {"tokens": 0, "steps": 0, "prompts": []})
            entry["tokens"] += len(generated) - 1
            entry["steps"] += steps
            entry["prompts"].append(prompt.id)
    for entry in out.values():
        entry["oracle_tokens_per_step"] = entry["tokens"] / max(entry["steps"], 1)
        entry.update(_measured(runs, entry.pop("prompts"), entry["oracle_tokens_per_step"]))
    return out


def _measured(runs: list[dict], prompt_ids: list[str], oracle: float) -> dict:
    """Lookahead's measured tokens per step over `prompt_ids`, and the speed-over-HF-greedy ceiling at `oracle`
    tokens per step (medians per prompt; None where the result lacks the runs)."""
    def median(method: str, key) -> dict[str, float]:
        values: dict[str, list[float]] = {}
        for run in runs:
            if run["method"] == method and run["prompt_id"] in prompt_ids and key(run) is not None:
                values.setdefault(run["prompt_id"], []).append(key(run))
        return {pid: statistics.median(v) for pid, v in values.items()}

    steps = median("lookahead", lambda r: r["new_tokens"] / r["tokens_per_step"] if r["tokens_per_step"] else None)
    new = median("lookahead", lambda r: r["new_tokens"])
    hf = median(REFERENCE, lambda r: r["seconds"])
    prefill = median("lookahead", lambda r: r.get("first_token_seconds"))
    per_token = median("lookahead_off", decode_seconds_per_token)
    measured = sum(new.values()) / sum(steps.values()) if steps else None
    complete = all(pid in d for d in (hf, prefill, per_token, new) for pid in prompt_ids)
    ceiling = None
    if complete:
        best = sum(prefill[pid] + (new[pid] - 1) * per_token[pid] / oracle for pid in prompt_ids)
        ceiling = sum(hf[pid] for pid in prompt_ids) / best
    return {"lookahead_tokens_per_step": measured, "ceiling": ceiling}


def format_table(rows: dict, min_match: int, max_copy: int) -> str:
    """The markdown table of `measure`'s rows."""
    def cell(value, fmt):
        return "–" if value is None else fmt.format(value)

    body = [[f"**{group}**" if group == "all" else group, cell(e["oracle_tokens_per_step"], "{:.2f}"),
             cell(e["lookahead_tokens_per_step"], "{:.2f}"), cell(e["ceiling"], "{:.2f}x")]
            for group, e in rows.items()]
    header = ["category", f"oracle copy tokens/step (match ≥ {min_match}, ≤ {max_copy} copied)",
              "lookahead tokens/step (measured)", "× HF greedy at the oracle's tokens/step"]
    return "\n".join(markdown_table(header, sorted(body, key=lambda r: r[0].startswith("**"))))


def main(argv: list[str] | None = None) -> None:
    """Replay the result's greedy outputs with the oracle copier; print the table."""
    args = parse_args(argv)
    result = json.loads(args.result.read_text())
    if not any(run["method"] == REFERENCE for run in result.get("runs", [])):
        sys.exit(f"error: {args.result} has no {REFERENCE} runs")
    _, tokenizer = load_target(args)
    categories = sorted({record["category"] for record in result["prompts"]})
    try:
        prompts = prompt_index(categories, args.prompts_dir)
        rows = measure(result, prompts, tokenizer, args.min_match, args.max_copy)
    except (KeyError, ValueError) as exc:
        sys.exit(f"error: {exc}")
    flags = " ".join(result.get("machine", {}).get("cpu_flags", [])) or "not recorded"
    print(f"Result: {args.result} (timings from a machine with CPU flags: {flags})")
    print(format_table(rows, args.min_match, args.max_copy))


if __name__ == "__main__":
    main()
