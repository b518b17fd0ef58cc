"""An editing session over long code files and two-turn chats: time to the first token and to the whole request.

    python benchmarks/bench_editing.py [--files 4] [--chats 4] [--max-new-tokens 64] [--repeats 2] [--threads 2]
        [--out F.json]

A completion tool sends the whole file up to the cursor on every pause, so most of a request's time on a long file
is its prompt's prefill. For each of `--files` long files (the `long_code` category: eight finished HumanEval
functions and a ninth to complete, 1180–1362 tokens) it replays four requests, as an editor sends them:

1. the file (nothing cached yet);
2. the file with the first 8 tokens of the completion accepted;
3. request 2 with a comment line inserted in the middle of the file (an edit above the cursor);
4. request 3 with Enter pressed at the end.

A chat client sends the whole conversation every turn: for each of `--chats` two-turn MT-bench questions (the
`chat` category), the first turn, then the second after the first answer (lookahead's, `--max-new-tokens` long).

Each request runs with every method, in rotated order: plain HF greedy, HF prompt lookup, lookahead (a fresh
prefill every time) and lookahead with the server's prompt cache (`lookahead.prompt_cache.PromptCache`, what
`lookahead serve` does: the kept text sharing the longest start with the prompt, cut to that start), one prompt
cache per session. Every output is compared token for token with HF greedy's. The table gives the median over
sessions and repetitions of the time to the first token and of the whole request, and the whole request's
speed-up.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from harness import (ForwardCounter, command_line, machine_info, markdown_table, mark_identity, progress_bar,
                     rotated, timed_run, write_json)
from prompts import load_prompts, second_turns

from lookahead.compat import CACHE_KWARG

EDITS = ("first send", "8 tokens accepted", "edited mid-file", "Enter pressed")
TURNS = ("chat: first turn", "chat: second turn")
REQUESTS = EDITS + TURNS
METHODS = ("hf_greedy", "hf_prompt_lookup", "lookahead", "lookahead_prompt_cache")
ACCEPTED = 8
PROMPT_LOOKUP_TOKENS = 10  # HF's prompt lookup drafts (as bench_generate's default)


def main(argv: list[str] | None = None) -> None:
    """Replay the sessions, print the table, write the JSON result."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import lookahead

    model, tokenizer = lookahead.load_model(None)
    files = [p.text for p in load_prompts(["long_code"], args.files)] if args.files else []
    chats = load_prompts(["chat"], args.chats) if args.chats else []
    machine = machine_info(args.threads)
    sessions = [file_session(model, tokenizer, file) for file in files]
    sessions += [chat_session(model, tokenizer, prompt.text, turn, args.max_new_tokens)
                 for prompt, turn in zip(chats, second_turns(chats))]
    runs = run_sessions(model, sessions, args.max_new_tokens, args.repeats)
    result = {"command": command_line(), "model": "SmolLM2-135M-Instruct (default)", "machine": machine,
              "settings": {"files": args.files, "chats": args.chats, "max_new_tokens": args.max_new_tokens,
                           "repeats": args.repeats, "dtype": "float32"},
              "runs": runs, "summary": summarize(runs)}
    print(format_table(result))
    if args.out:
        write_json(result, args.out)


def session_texts(file: str, completion: str) -> list[str]:
    """The four requests' texts (EDITS) for `file`, given the text of the first `ACCEPTED` tokens of its
    completion."""
    accepted = file + completion
    lines = accepted.split("\n")
    middle = len(lines) // 2
    edited = "\n".join(lines[:middle] + ["# reviewed"] + lines[middle:])
    return [file, accepted, edited, edited + "\n"]


def file_session(model, tokenizer, file: str) -> list[tuple[str, torch.Tensor]]:
    """(request, prompt ids [1, L]) of the editing session over `file` (EDITS)."""
    from lookahead import Lookahead

    ids = tokenizer(file, return_tensors="pt").input_ids
    first = model.generate(ids, max_new_tokens=ACCEPTED, do_sample=False, custom_generate=Lookahead())
    texts = session_texts(file, tokenizer.decode(first[0, ids.shape[1]:]))
    return [(request, tokenizer(text, return_tensors="pt").input_ids) for request, text in zip(EDITS, texts)]


def chat_session(model, tokenizer, first: str, second: str, max_new_tokens: int) -> list[tuple[str, torch.Tensor]]:
    """(request, prompt ids [1, L]) of a two-turn chat (TURNS): `first`, then `second` after the model's greedy
    answer to `first` (`max_new_tokens` long, as the client shows it)."""
    from lookahead import Lookahead

    def encode(messages: list[dict]) -> torch.Tensor:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids

    messages = [{"role": "user", "content": first}]
    ids = encode(messages)
    answer = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, custom_generate=Lookahead())
    messages += [{"role": "assistant", "content": tokenizer.decode(answer[0, ids.shape[1]:], skip_special_tokens=True)},
                 {"role": "user", "content": second}]
    return [(TURNS[0], ids), (TURNS[1], encode(messages))]


def run_sessions(model, sessions: list[list[tuple[str, torch.Tensor]]], max_new_tokens: int,
                 repeats: int) -> list[dict]:
    """Every session's requests `repeats` times, each with every method (rotated); one run record each."""
    bar = progress_bar(repeats * sum(map(len, sessions)) * len(METHODS))
    runs = []
    with ForwardCounter(model) as counter:
        for repeat in range(repeats):
            for index, session in enumerate(sessions):
                store = _new_store()  # the server starts the session with nothing cached
                for step, (request, ids) in enumerate(session):
                    group = [_run(model, ids, method, max_new_tokens, counter, store)
                             for method in rotated(METHODS, repeat + step + index)]
                    mark_identity(group)
                    for run in group:
                        run.update(session=index, request=request, repeat=repeat)
                        bar.update()
                    runs += group
    bar.close()
    return runs


def _new_store():
    """An empty prompt cache with the server's default bound."""
    from lookahead.prompt_cache import PromptCache
    from lookahead.server import ServerSettings

    return PromptCache(ServerSettings().prompt_cache_bytes)


def _run(model, ids: torch.Tensor, method: str, max_new_tokens: int, counter: ForwardCounter, store) -> dict:
    """One timed request of `method`; `store` is the prompt cache of the lookahead_prompt_cache method."""
    from lookahead import Lookahead

    kwargs, kv, cached = {"do_sample": False}, None, 0
    if method == "hf_prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    elif method.startswith("lookahead"):
        kwargs["custom_generate"] = Lookahead()
    if method == "lookahead_prompt_cache":
        kv, cached = store.take(ids[0].tolist(), model.config)
        kwargs[CACHE_KWARG] = kv
    run = timed_run(model, ids, method, max_new_tokens, counter, clock_first_token=True, **kwargs)
    if kv is not None:
        store.keep(ids[0].tolist() + run["tokens"], kv)
    return run | {"cached_tokens": cached}


def summarize(runs: list[dict]) -> dict:
    """Per request kind and method: medians of `first_token_seconds` and `seconds`, prompt and cached tokens,
    outputs identical to HF greedy's (count of compared runs and of identical ones)."""
    summary = {}
    for request in REQUESTS:
        for method in METHODS:
            mine = [r for r in runs if r["request"] == request and r["method"] == method]
            if not mine:
                continue
            compared = [r for r in mine if r["identical"] is not None]
            summary.setdefault(request, {})[method] = {
                "first_token_seconds": statistics.median(r["first_token_seconds"] for r in mine),
                "seconds": statistics.median(r["seconds"] for r in mine),
                "prompt_tokens": statistics.median(r["prompt_tokens"] for r in mine),
                "cached_tokens": statistics.median(r["cached_tokens"] for r in mine),
                "compared": len(compared), "identical": sum(bool(r["identical"]) for r in compared)}
    return summary


def format_table(result: dict) -> str:
    """Markdown: per request, prompt and reused tokens, the time to the first token and of the whole request per
    method, and lookahead with the prompt cache against HF greedy, HF prompt lookup and lookahead alone."""
    rows = []
    for request, methods in result["summary"].items():
        cached = methods.get("lookahead_prompt_cache", {})
        first = " · ".join(f"{methods[m]['first_token_seconds']:.3f}" for m in METHODS if m in methods)
        whole = " · ".join(f"{methods[m]['seconds']:.3f}" for m in METHODS if m in methods)
        ratios = " · ".join(f"{methods[m]['seconds'] / cached['seconds']:.2f}x"
                            for m in METHODS[:3] if m in methods and cached)
        same = sum(e["identical"] for e in methods.values())
        compared = sum(e["compared"] for e in methods.values())
        rows.append([request, f"{methods['hf_greedy']['prompt_tokens']:.0f}", f"{cached.get('cached_tokens', 0):.0f}",
                     first, whole, ratios, f"{same}/{compared}"])
    machine, settings = result["machine"], result["settings"]
    head = (f"CPU: {machine['cpu']} (flags {' '.join(machine['cpu_flags'])}), {machine['threads']} threads; "
            f"{settings['files']} files, {settings['chats']} chats, {settings['max_new_tokens']} new tokens, "
            f"{settings['repeats']} repetitions; "
            f"medians in seconds, methods in the order {', '.join(METHODS)}\n\nCommand: `{result['command']}`\n")
    header = ["request", "prompt tokens", "reused", "first token (s)", "whole request (s)",
              "prompt cache vs HF greedy · HF PL · lookahead", "identical"]
    return head + "\n" + "\n".join(markdown_table(header, rows))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if min(args.max_new_tokens, args.repeats, args.threads) < 1 or min(args.files, args.chats) < 0:
        parser.error("--max-new-tokens, --repeats and --threads must be at least 1, --files and --chats at least 0")
    if args.files + args.chats == 0:
        parser.error("nothing to run: --files and --chats are both 0")
    return args


if __name__ == "__main__":
    main()
