"""Benchmark prompts from the vendored `data/prompts` (licences in its README), grouped into the suite's
categories, and their encoding.

Each suite category draws from one prompt file and one or more source categories of it:

| category       | file               | source categories                                  | chat template |
|----------------|--------------------|----------------------------------------------------|---------------|
| code           | humaneval.jsonl    | code (complete the function body)                  | no            |
| summarization  | spec_bench.jsonl   | summarization                                      | yes           |
| rag            | spec_bench.jsonl   | rag                                                | yes           |
| translation    | spec_bench.jsonl   | translation                                        | yes           |
| math_reasoning | spec_bench.jsonl   | math_reasoning                                     | yes           |
| qa             | spec_bench.jsonl   | qa                                                 | yes           |
| chat           | spec_bench.jsonl   | the 8 MT-Bench categories (writing, roleplay, ...) | yes           |
| long_code      | humaneval.jsonl    | code: a file of LONG_CONTEXT finished functions, then one to complete | no |

HumanEval prompts are code to be continued, so they are encoded as plain text; Spec-Bench prompts are
instructions and go through the model's chat template. MT-Bench items have two turns; only the first is used
(the second needs the model's own first answer). Selection is deterministic: the first prompts of the file,
taken round-robin over the source categories (so 4 `chat` prompts are writing, roleplay, reasoning, math).

`long_code` is what a code-completion tool sends from a long file: HumanEval items taken LONG_CONTEXT + 1 at a time,
the first LONG_CONTEXT written out whole (prompt and reference body, text unchanged, one after the other) and the
last one's prompt to complete (~1300–2000 tokens with the default model's tokenizer). Not in the default suite.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_PROMPTS_DIR = Path(__file__).resolve().parents[1] / "data" / "prompts"
LONG_CONTEXT = 8  # finished functions before each long_code prompt
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


@dataclass(frozen=True)
class CategorySpec:
    """Where a suite category's prompts come from and whether they are wrapped in the chat template."""

    file: str
    sources: tuple[str, ...]
    chat: bool
    context: int = 0  # finished items written before each prompt (a long file), or 0: the item alone


CATEGORIES = {
    "code": CategorySpec("humaneval.jsonl", ("code",), chat=False),
    "summarization": CategorySpec("spec_bench.jsonl", ("summarization",), chat=True),
    "rag": CategorySpec("spec_bench.jsonl", ("rag",), chat=True),
    "translation": CategorySpec("spec_bench.jsonl", ("translation",), chat=True),
    "math_reasoning": CategorySpec("spec_bench.jsonl", ("math_reasoning",), chat=True),
    "qa": CategorySpec("spec_bench.jsonl", ("qa",), chat=True),
    "chat": CategorySpec("spec_bench.jsonl", MT_BENCH, chat=True),
    "long_code": CategorySpec("humaneval.jsonl", ("code",), chat=False, context=LONG_CONTEXT),
}
DEFAULT_CATEGORIES = ("code", "summarization", "rag", "translation", "math_reasoning", "chat")


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: `text` is the raw first turn; `chat` says whether to apply the chat template."""

    id: str
    category: str
    text: str
    chat: bool


def load_prompts(categories, per_category: int, prompts_dir: str | Path = DEFAULT_PROMPTS_DIR,
                 skip: int = 0) -> list[Prompt]:
    """Return `per_category` prompts for each of `categories`, grouped by category in the given order, after the
    first `skip` of each category (held-out runs: the defaults were tuned on the suite's first prompts).

    Raises `ValueError` for an unknown category, a missing prompt file, a negative `skip`, or a category with too
    few prompts.
    """
    if per_category < 1:
        raise ValueError(f"prompts per category must be at least 1, got {per_category}")
    if skip < 0:
        raise ValueError(f"prompts to skip must be at least 0, got {skip}")
    prompts: list[Prompt] = []
    for name in categories:
        every = _category_prompts(name, prompts_dir)
        if len(every) < skip + per_category:
            wanted = f"{skip} skipped and {per_category}" if skip else str(per_category)
            raise ValueError(f"category {name!r} has only {len(every)} prompts, {wanted} requested")
        prompts += every[skip:skip + per_category]
    return prompts


def prompt_index(categories, prompts_dir: str | Path = DEFAULT_PROMPTS_DIR) -> dict[str, Prompt]:
    """Every prompt of `categories` by id (to find a result file's prompts, whichever its run skipped)."""
    return {prompt.id: prompt for name in categories for prompt in _category_prompts(name, prompts_dir)}


def second_turns(prompts: list[Prompt], prompts_dir: str | Path = DEFAULT_PROMPTS_DIR) -> list[str]:
    """The second user turn of each of `prompts` (chat-category prompts: MT-bench questions have two turns);
    `ValueError` for a prompt without one."""
    by_id = {item["id"]: item for group in _read_by_source(Path(prompts_dir) / CATEGORIES["chat"].file,
                                                             MT_BENCH).values() for item in group}
    turns = []
    for prompt in prompts:
        item = by_id.get(prompt.id)
        if item is None or len(item["turns"]) < 2:
            raise ValueError(f"prompt {prompt.id} has no second turn")
        turns.append(item["turns"][1])
    return turns


def _category_prompts(name: str, prompts_dir: str | Path) -> list[Prompt]:
    """All prompts of suite category `name` in selection order; `ValueError` for an unknown category."""
    if name not in CATEGORIES:
        raise ValueError(f"unknown categories {[name]}; valid categories: {sorted(CATEGORIES)}")
    spec = CATEGORIES[name]
    by_source = _read_by_source(Path(prompts_dir) / spec.file, spec.sources)
    items = _round_robin([by_source[source] for source in spec.sources], sum(map(len, by_source.values())))
    if spec.context:
        return [_long_prompt(name, items[start:start + spec.context + 1])
                for start in range(0, len(items) - spec.context, spec.context + 1)]
    return [Prompt(id=item["id"], category=name, text=item["turns"][0], chat=spec.chat) for item in items]


def _long_prompt(name: str, items: list[dict]) -> Prompt:
    """A long-file prompt: every item but the last written out whole (prompt, then its reference body), then the
    last item's prompt; its id is the last item's with the first item's after a "+"."""
    finished = "".join(item["turns"][0] + item["reference"] + "\n\n" for item in items[:-1])
    return Prompt(id=f"{items[-1]['id']}+{items[0]['id']}", category=name, text=finished + items[-1]["turns"][0],
                  chat=False)


def encode(tokenizer, prompt: Prompt) -> torch.Tensor:
    """Token ids `[1, L]` of `prompt`, through the tokenizer's chat template when `prompt.chat`.

    Raises `ValueError` if a chat prompt meets a tokenizer without a chat template.
    """
    text = prompt.text
    if prompt.chat:
        if not tokenizer.chat_template:
            raise ValueError(f"prompt {prompt.id} needs a chat template, but the tokenizer has none")
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The chat template already holds any special tokens the model expects at the start.
    return tokenizer(text, return_tensors="pt", add_special_tokens=not prompt.chat).input_ids


def _read_by_source(path: Path, sources: tuple[str, ...]) -> dict[str, list[dict]]:
    """Items of the JSONL file `path` whose `category` is one of `sources`, per source, in file order."""
    if not path.is_file():
        raise ValueError(f"prompt file not found: {path} (pass --prompts-dir)")
    by_source: dict[str, list[dict]] = {source: [] for source in sources}
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                item = json.loads(line)
                if item["category"] in by_source:
                    by_source[item["category"]].append(item)
    return by_source


def _round_robin(groups: list[list[dict]], count: int) -> list[dict]:
    """Up to `count` items taken from `groups` in turn: first of each group, then second of each, ..."""
    picked: list[dict] = []
    for rank in range(max((len(group) for group in groups), default=0)):
        picked += [group[rank] for group in groups if rank < len(group)]
    return picked[:count]
