"""An editor re-sending the same file after a small edit: tokens per step of the server's cross-request cache.

    python benchmarks/bench_resend.py [--problems 3] [--max-tokens 64] [--threads 2] [--out FILE.json]

Code-completion tools send the whole file (up to the cursor) on every keystroke pause, so consecutive requests
share most of their text and often most of their completion. For each of `--problems` HumanEval prompts
(data/prompts), a `lookahead serve` app with the default model (in-process, through the HTTP app and its engine)
answers: the file as is (cold: the suffix cache has never seen it), then the same file with a small edit above
the cursor (a renamed word in the docstring). Both are greedy `/v1/completions` requests; the table shows each
one's tokens per step and tokens/s as the server reports them (`lookahead` field) and which drafters' tokens
were accepted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from harness import command_line, cpu_flags, machine_info, markdown_table, write_json
from prompts import DEFAULT_PROMPTS_DIR


def main(argv: list[str] | None = None) -> None:
    """Serve the default model in-process, send each file twice, print the table, write JSON."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from starlette.testclient import TestClient

    import lookahead
    from lookahead.server import ServerSettings, create_app
    from lookahead.suffix_cache import SuffixCache

    model, tokenizer = lookahead.load_model(None)
    app = create_app(model, tokenizer, ServerSettings(), SuffixCache())
    rows = []
    with TestClient(app, base_url="http://127.0.0.1") as client:
        for index, source in enumerate(code_prompts(args.problems)):
            edited = small_edit(source)
            for kind, text in (("first send", source), ("re-sent after an edit", edited)):
                body = {"model": "smollm2-135m-instruct", "prompt": text, "max_tokens": args.max_tokens,
                        "temperature": 0}
                answer = client.post("/v1/completions", json=body)
                answer.raise_for_status()
                rows.append({"problem": index, "request": kind, **answer.json()["lookahead"]})
    result = {"command": command_line(), "machine": machine_info(args.threads), "cpu_flags": cpu_flags(),
              "max_tokens": args.max_tokens, "requests": rows}
    print(format_table(result))
    if args.out:
        write_json(result, args.out)


def code_prompts(count: int) -> list[str]:
    """The first `count` HumanEval prompts of data/prompts (function signature and docstring)."""
    path = Path(DEFAULT_PROMPTS_DIR) / "humaneval.jsonl"
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [entry["turns"][0] for entry in lines[:count]]


def small_edit(source: str) -> str:
    """`source` with one word of its docstring changed ("Return" → "Give back", else a word appended to the
    first comment-free line), as an editor's small change above the cursor."""
    if "Return" in source:
        return source.replace("Return", "Give back", 1)
    head, _, tail = source.partition("\n")
    return f"{head}  # edited\n{tail}"


def format_table(result: dict) -> str:
    """Markdown: per problem and request, tokens per step, tokens/s and accepted drafts by drafter."""
    rows = [[str(r["problem"]), r["request"], f"{r['tokens_per_step']:.2f}", f"{r['tokens_per_second']:.1f}",
             ", ".join(f"{k}={v}" for k, v in sorted(r["accepted_by_drafter"].items())) or "-"]
            for r in result["requests"]]
    head = (f"CPU flags: {' '.join(result['cpu_flags'])}; {result['machine']['cpu']}, "
            f"{result['machine']['threads']} threads; max_tokens {result['max_tokens']}\n\n"
            f"Command: `{result['command']}`\n")
    return head + "\n" + "\n".join(markdown_table(["problem", "request", "tokens/step", "tok/s", "accepted drafts"],
                                                  rows))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if min(args.problems, args.max_tokens, args.threads) < 1:
        parser.error("--problems, --max-tokens and --threads must be at least 1")
    return args


if __name__ == "__main__":
    main()
