"""The original Lookahead Decoding package (`lade` 0.0.2) against plain HF greedy, on the suite's prompts.

    $LADE_VENV/bin/python benchmarks/bench_lade.py [--model HF_FOLDER] [--categories code rag ...]
        [--prompts-per-category 3] [--max-new-tokens 96] [--repeats 2] [--threads 2]
        [--level 5 --window 7 --guess 7 | --lade-config 5,7,7 --lade-config level=3,window=3,guess=3 ...]
        [--reference benchmarks/results/smollm2-cpu.json] [--out benchmarks/results/lade-cpu.json]

Why a separate script and environment: lade 0.0.2 (hao-ai-lab/LookaheadDecoding, Nov 2023) monkey-patches
`GenerationMixin.greedy_search` and Llama internals (`_expand_mask`, tuple KV caches) of transformers 4.34;
under transformers 5.23 `import lade` fails with "ImportError: cannot import name 'GreedySearchOutput' from
'transformers.generation.utils'" (and 5.x has neither `greedy_search` nor `_expand_mask`). So it runs in its own
venv (`benchmarks/lade_setup.sh`: torch 2.13.0 CPU, transformers 4.34.0 with tokenizers 0.14.1,
huggingface-hub 0.17.3 and numpy 1.26.4, lade --no-deps) on an HF folder saved from the default model
(SmolLM2-135M-Instruct, a Llama) by the main environment and rewritten for 4.34 (`make_folder_compatible`:
`rope_parameters` → `rope_theta` — without it 4.34 would silently use RoPE base 10000 instead of 100000 —,
`dtype` → `torch_dtype`, no `quantization_config: null`, the chat template inside `tokenizer_config.json`,
BPE merges as "a b" strings for tokenizers 0.14). This module must stay importable in the MAIN environment
(its tests run there): lade, transformers and tqdm are imported inside functions only.

What runs: all runs share one process and the same encoded prompts (`prompts.py`, as in
`bench_generate.py`), greedy (`do_sample=False`), fp32, batch 1. Methods are `hf_greedy` (plain
`generate` of transformers 4.34) and one `lade_nN_wW_gG` per lade config (N = LEVEL, the n-gram size;
W = WINDOW_SIZE; G = GUESS_SET_SIZE; lade's README uses 5/7/7). lade is switched on and off within the process:
`lade.augment_all()` replaces `greedy_search` once by a proxy that reads the environment variable `USE_LADE`
on every call (`USE_LADE=0` → the original 4.34 `greedy_search`), and `lade.config_lade(...)` sets the sizes
in a module dict read at the start of each call; so methods are interleaved like the main suite: one untimed
warm-up run per method, then every repetition visits every prompt and runs all methods in an order rotated
from prompt to prompt. lade 0.0.2's `config_lade` has no `USE_FLASH` option (later GitHub versions do); on
CPU there is no flash attention anyway. lade exposes its step count only as a DEBUG print, so steps are
counted by wrapping the model's `jforward_multilevel` (lade's only forward; HF greedy is counted with a forward
pre-hook). Each run records seconds, new tokens, tokens/s, forwards (prefill included), tokens per step and
whether its tokens equal HF greedy's on the same prompt and repetition. The summary is
`harness.summarize` (same definitions as the main suite: per category, sums over prompts of median
times, speedup = ratio of those sums). With `--reference` (a main-suite JSON, by default
benchmarks/results/smollm2-cpu.json when it exists) the table also shows lookahead's speedup from that file
and checks that 4.34 greedy gives the same tokens as the main suite's 5.23 greedy (same model, same prompts).

Compatibility found here (torch 2.13, transformers 4.34.0): transformers warns that
`torch.utils._pytree._register_pytree_node` is deprecated (harmless); 4.34's `apply_chat_template` has no
`add_generation_prompt` (it silently drops it), so `prompts.encode` is given `Tokenizer434`, which renders
the template with it (checked: all 21 suite prompts, 7 categories x 3, encode to the same ids as in the main
environment). In the smoke run HF greedy under 4.34 gave the main suite's 5.23 greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from harness import (REFERENCE, RESULTS_DIR, ForwardCounter, check_counts, close_load_average, common_parser,
                     group_name, headed, interleaved_runs, machine_info, machine_line, markdown_table,
                     progress_bar, prompt_records, publish, speedup_cell, summarize, timed_run)
from prompts import Prompt, encode, load_prompts

DEFAULT_MODEL_DIR = Path(os.environ.get("LOOKAHEAD_CACHE", Path.home() / ".cache" / "lookahead")) / "smollm2-hf"
DEFAULT_REFERENCE = RESULTS_DIR / "smollm2-cpu.json"
MARKER = ".lade-compatible"


@dataclass(frozen=True)
class LadeConfig:
    """lade's three sizes: `level` N (n-gram size), `window` W (lookahead window), `guess` G (n-grams verified)."""

    level: int
    window: int
    guess: int

    def __post_init__(self):
        if self.level < 3 or self.window < 1 or self.guess < 1:
            raise ValueError(f"lade needs level >= 3, window >= 1 and guess >= 1, got level={self.level}, "
                             f"window={self.window}, guess={self.guess}")

    @property
    def method(self) -> str:
        """The method name of runs with this config, e.g. `lade_n5_w7_g7`."""
        return f"lade_n{self.level}_w{self.window}_g{self.guess}"


def parse_lade_config(text: str) -> LadeConfig:
    """`"5,7,7"` (LEVEL,WINDOW,GUESS) or `"level=5,window=7,guess=7"` (any order) → `LadeConfig`.

    Raises `ValueError` naming the bad text, an unknown or missing name, a non-integer or a size out of range.
    """
    parts = [part.strip() for part in text.split(",")]
    if len(parts) != 3:
        raise ValueError(f"a lade config is LEVEL,WINDOW,GUESS or level=N,window=W,guess=G; got {text!r}")
    names = ("level", "window", "guess")
    if all("=" not in part for part in parts):
        pairs = dict(zip(names, parts))
    else:
        pairs = dict(part.partition("=")[::2] for part in parts)
        pairs = {name.strip(): value.strip() for name, value in pairs.items()}
        if sorted(pairs) != sorted(names):
            raise ValueError(f"a lade config names each of level, window, guess once; got {text!r}")
    try:
        return LadeConfig(**{name: int(value) for name, value in pairs.items()})
    except ValueError as exc:
        raise ValueError(f"bad lade config {text!r}: {exc}") from None


# ---- the HF folder for transformers 4.34 (run by lade_setup.sh in the main environment) ----

def make_folder_compatible(folder: str | Path) -> list[str]:
    """Rewrite an HF folder saved by transformers 5 so that transformers 4.34 / tokenizers 0.14 load the same
    model and tokenizer; then write the marker file `.lade-compatible`. Returns the changes made (strings).

    Raises `ValueError` for what 4.34 cannot express (a quantized model, non-default RoPE, biases, an odd head
    size, BPE `ignore_merges`).
    """
    folder = Path(folder)
    changes = _rewrite_json(folder / "config.json", fix_config)
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
    changes += _rewrite_json(folder / "tokenizer_config.json", lambda cfg: fix_tokenizer_config(cfg, template))
    changes += _rewrite_json(folder / "tokenizer.json", fix_tokenizer_json)
    (folder / MARKER).write_text("rewritten for transformers 4.34 by benchmarks/bench_lade.py\n", encoding="utf-8")
    return changes


def _rewrite_json(path: Path, fix) -> list[str]:
    """Apply `fix` (dict → list of changes, edits in place) to the JSON file `path`; rewrite it if changed."""
    data = json.loads(path.read_text(encoding="utf-8"))
    changes = fix(data)
    if changes:
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return [f"{path.name}: {change}" for change in changes]


def fix_config(config: dict) -> list[str]:
    """Make a transformers-5 Llama `config.json` dict readable by 4.34 as the same model (in place; returns
    the changes). Raises `ValueError` for settings 4.34 does not have."""
    changes = []
    if "quantization_config" in config:
        if config.pop("quantization_config") is not None:
            raise ValueError("a quantized model cannot be loaded by transformers 4.34 here")
        changes.append("dropped quantization_config: null")
    rope = config.pop("rope_parameters", None)
    if rope is not None:
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported here")
        config["rope_theta"] = rope["rope_theta"]
        changes.append(f"rope_parameters -> rope_theta={rope['rope_theta']}")
    config.pop("dtype", None)
    config["torch_dtype"] = "float32"
    changes.append("torch_dtype=float32")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("attention/MLP biases are not supported by transformers 4.34's Llama")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * config["num_attention_heads"] != config["hidden_size"]:
        raise ValueError(f"head_dim {head_dim} != hidden_size / num_attention_heads, which 4.34 assumes")
    return changes


def fix_tokenizer_config(config: dict, chat_template: str | None) -> list[str]:
    """Make a transformers-5 `tokenizer_config.json` dict loadable by 4.34 (in place; returns the changes):
    the generic fast tokenizer class, the chat template inside the file, no v5 bookkeeping keys."""
    changes = []
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        changes.append("tokenizer_class=PreTrainedTokenizerFast")
    if chat_template is not None and config.get("chat_template") != chat_template:
        config["chat_template"] = chat_template
        changes.append("chat_template from chat_template.jinja")
    for key in ("backend", "is_local", "local_files_only"):
        if config.pop(key, None) is not None:
            changes.append(f"dropped {key}")
    return changes


def fix_tokenizer_json(tokenizer: dict) -> list[str]:
    """Make a `tokenizer.json` dict readable by tokenizers 0.14 (in place; returns the changes): BPE merges as
    "a b" strings, no `ignore_merges`. Raises `ValueError` if `ignore_merges` is on or a merge holds a space."""
    model, changes = tokenizer["model"], []
    if model.get("type") != "BPE":
        return changes
    if model.pop("ignore_merges", False):
        raise ValueError("BPE ignore_merges=true is not supported by tokenizers 0.14")
    if any(not isinstance(merge, str) for merge in model["merges"]):
        if any(" " in part for merge in model["merges"] for part in merge):
            raise ValueError("a BPE merge contains a space; tokenizers 0.14 cannot express it")
        model["merges"] = [merge if isinstance(merge, str) else " ".join(merge) for merge in model["merges"]]
        changes.append("BPE merges as 'a b' strings")
    return changes


# ---- running (inside the lade venv) ----

class Tokenizer434:
    """A tokenizer proxy for `prompts.encode` under transformers 4.34, whose `apply_chat_template` silently
    ignores `add_generation_prompt`: this one passes it to the template. Everything else is delegated."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = False) -> str:
        """The rendered chat template (text only; raises `ValueError` for `tokenize=True`)."""
        if tokenize:
            raise ValueError("Tokenizer434.apply_chat_template renders text only (tokenize=False)")
        template = self._tokenizer._compile_jinja_template(self._tokenizer.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **self._tokenizer.special_tokens_map)


def load_model(folder: Path):
    """`(model, Tokenizer434)` from an HF folder, fp32, eval mode, with lade's patches installed."""
    import warnings

    warnings.filterwarnings("ignore", message=".*_register_pytree_node.*", category=FutureWarning)  # 4.34 on 2.13
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    enable_lade()
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    return model, Tokenizer434(AutoTokenizer.from_pretrained(folder))


def enable_lade() -> None:
    """Install lade's patches once (`augment_all` twice would make its proxy call itself)."""
    import lade
    from lade.decoding import FUNC_MAP

    if "greedy_search" not in FUNC_MAP:
        lade.augment_all()
    os.environ["CHAT"] = "0"  # lade's proxy would print the text as it decodes


def switch_lade(config: LadeConfig | None) -> None:
    """Make the next `generate` call use lade with `config`, or plain HF greedy when `config` is None."""
    import lade

    os.environ["USE_LADE"] = "0" if config is None else "1"
    if config is not None:
        lade.config_lade(LEVEL=config.level, WINDOW_SIZE=config.window, GUESS_SET_SIZE=config.guess, DEBUG=0)


class StepCounter(ForwardCounter):
    """Counts target forwards while active: `model.forward` calls (HF greedy) and calls of lade's
    `model.jforward_multilevel` (lade never calls `forward`). A context manager."""

    def __enter__(self) -> "StepCounter":
        super().__enter__()
        lade_forward = type(self.model).jforward_multilevel

        def counted(*args, **kwargs):
            self.count += 1
            return lade_forward(self.model, *args, **kwargs)

        self.model.jforward_multilevel = counted  # an instance attribute shadows the class's
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        del self.model.jforward_multilevel


def lade_run(model, input_ids, config: LadeConfig | None, max_new_tokens: int, counter: StepCounter) -> dict:
    """Generate once greedily (lade with `config`, or plain HF when None) and measure it: the fields of
    `harness.timed_run` (`method`, `seconds`, `prompt_tokens`, `new_tokens`, `tokens_per_second`, `forwards`,
    `tokens_per_step`, `tokens`)."""
    switch_lade(config)
    return timed_run(model, input_ids, REFERENCE if config is None else config.method, max_new_tokens, counter,
                     do_sample=False)


def run_suite(model, tokenizer, prompts: list[Prompt], configs: list[LadeConfig], repeats: int,
              max_new_tokens: int, progress: bool = True) -> dict:
    """Run HF greedy and every lade config on every prompt `repeats` times (interleaved, rotated order, after
    one untimed warm-up per method). Returns `settings`, `prompts`, `runs` and `summary` (`summarize`)."""
    methods = method_table(configs)
    encoded = [encode(tokenizer, prompt) for prompt in prompts]  # [1, L] each
    bar = progress_bar(len(methods) * (1 + repeats * len(prompts)), progress)
    with StepCounter(model) as counter:
        for method, config in methods.items():  # warm-up, not recorded
            lade_run(model, encoded[0], config, max_new_tokens, counter)
            bar.update()
        runs = interleaved_runs(prompts, encoded, list(methods), repeats, bar,
                                lambda input_ids, method, _prompt_id: lade_run(model, input_ids, methods[method],
                                                                               max_new_tokens, counter))
    bar.close()
    return {"settings": {"methods": list(methods), "lade_configs": [vars(c) for c in configs],
                         "repeats": repeats, "max_new_tokens": max_new_tokens, "dtype": "float32"},
            "prompts": prompt_records(prompts, encoded), "runs": runs, "summary": summarize(runs, list(methods))}


def method_table(configs: list[LadeConfig]) -> dict[str, LadeConfig | None]:
    """`{"hf_greedy": None, "lade_n5_w7_g7": LadeConfig(5, 7, 7), ...}`; raises `ValueError` on duplicates."""
    methods = {REFERENCE: None, **{config.method: config for config in configs}}
    if len(methods) != len(configs) + 1:
        raise ValueError(f"lade configs must be distinct, got {[config.method for config in configs]}")
    return methods


# ---- the main suite's numbers beside lade's ----

def reference_check(result: dict, reference: dict) -> dict:
    """Compare this run's HF greedy tokens (transformers 4.34) with the main suite's `hf_greedy` tokens on the
    same prompt ids, over the shorter length. Returns `{"compared", "identical", "diverged": {id: index}}`."""
    ours = {run["prompt_id"]: run["tokens"] for run in result["runs"] if run["method"] == REFERENCE}
    theirs = {run["prompt_id"]: run["tokens"] for run in reference.get("runs", [])
              if run["method"] == REFERENCE and "tokens" in run}
    diverged = {}
    shared = [pid for pid in ours if pid in theirs]
    for pid in shared:
        pairs = list(zip(ours[pid], theirs[pid]))
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        if first is not None:
            diverged[pid] = first
    return {"compared": len(shared), "identical": len(shared) - len(diverged), "diverged": diverged}


def format_tables(result: dict) -> str:
    """Markdown: a line naming machine, versions and sizes, the command, the reference check, then one table
    per lade config with rows per category and **all**."""
    lines = [machine_line(result, "lade"), "", f"Command: `{result['command']}`", ""]
    check = result.get("reference_check")
    if check:
        lines += [f"HF greedy 4.34 vs the main suite's HF greedy ({result['reference']}): "
                  f"{check['identical']}/{check['compared']} prompts token-identical"
                  + (f", first divergence at {check['diverged']}" if check["diverged"] else ""), ""]
    for method in result["settings"]["methods"]:
        if method != REFERENCE:
            lines += _method_table(result, method) + [""]
    return "\n".join(lines).rstrip() + "\n"


def _method_table(result: dict, method: str) -> list[str]:
    """Rows of one lade config's table: greedy and lade tok/s, speedup, tok/step, identity, our speedup."""
    header = ["category", "prompts", "HF greedy 4.34 tok/s", f"{method} tok/s", "× greedy (median / min)",
              "tokens/step", "identical", "lookahead × greedy (main suite)"]
    rows = []
    for group, per_method in result["summary"].items():
        entry, greedy = per_method[method], per_method[REFERENCE]
        rows.append([group_name(group), str(entry["prompts"]), f"{greedy['tokens_per_second']:.1f}",
                     f"{entry['tokens_per_second']:.1f}", speedup_cell(entry, REFERENCE),
                     f"{entry['tokens_per_step']:.2f}",
                     f"{entry['identical_runs']}/{entry['checked_runs']}" if entry["checked_runs"] else "–",
                     _ours(result.get("reference_speedups"), group)])
    return markdown_table(header, rows)


def _ours(speedups: dict | None, group: str) -> str:
    """lookahead's speedup over HF greedy in the main suite for `group` (`reference_speedups`), or a dash."""
    speedup = (speedups or {}).get(group)
    return f"{speedup:.2f}x" if speedup is not None else "–"


def reference_speedups(reference: dict) -> dict[str, float]:
    """`{group: speedup}`: the `lookahead` method's median-based speedup over HF greedy per category (and
    "all") in a main-suite result; groups without it are left out."""
    key = f"speedup_vs_{REFERENCE}"
    return {group: per_method["lookahead"][key] for group, per_method in reference.get("summary", {}).items()
            if key in per_method.get("lookahead", {})}


# ---- command line ----

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring); errors exit through `parser.error` (one line)."""
    parser = common_parser(__doc__.splitlines()[0], prompts_per_category=3, repeats=2, model=False)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR, help="HF folder (lade_setup.sh)")
    parser.set_defaults(max_new_tokens=96)
    parser.add_argument("--level", type=int, default=None, help="lade LEVEL N, the n-gram size (default 5)")
    parser.add_argument("--window", type=int, default=None, help="lade WINDOW_SIZE W (default 7)")
    parser.add_argument("--guess", type=int, default=None, help="lade GUESS_SET_SIZE G (default 7)")
    parser.add_argument("--lade-config", action="append", default=[], metavar="N,W,G",
                        help="a lade config LEVEL,WINDOW,GUESS or level=N,window=W,guess=G (repeatable)")
    parser.add_argument("--reference", type=Path, default=None,
                        help="a main-suite JSON to compare with (default: results/smollm2-cpu.json if present)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "lade-cpu.json", help="JSON path")
    parser.add_argument("--no-progress", action="store_true", help="no progress indicator")
    args = parser.parse_args(argv)
    try:
        _finish_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def _finish_args(args: argparse.Namespace) -> None:
    """Check counts, build `args.lade_configs`, resolve `args.reference`, load `args.prompts`; raises
    `ValueError` naming the first bad option."""
    check_counts(args, ("prompts_per_category", "max_new_tokens", "repeats", "threads"))
    sizes = (args.level, args.window, args.guess)
    if args.lade_config and any(size is not None for size in sizes):
        raise ValueError("give either --level/--window/--guess or --lade-config, not both")
    if args.lade_config:
        args.lade_configs = [parse_lade_config(text) for text in args.lade_config]
    else:
        args.lade_configs = [LadeConfig(*(d if s is None else s for s, d in zip(sizes, (5, 7, 7))))]
    method_table(args.lade_configs)  # distinct
    if args.reference is None and DEFAULT_REFERENCE.is_file():
        args.reference = DEFAULT_REFERENCE
    if args.reference is not None and not args.reference.is_file():
        raise ValueError(f"--reference file not found: {args.reference}")
    if not (args.model / "config.json").is_file():
        raise ValueError(f"--model {args.model} is not an HF folder (run benchmarks/lade_setup.sh first)")
    args.prompts = load_prompts(args.categories, args.prompts_per_category, args.prompts_dir, args.skip_prompts)


def main(argv: list[str] | None = None) -> None:
    """Run the comparison from the command line; print the markdown tables and write the JSON."""
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    machine = machine_info(args.threads, "lade")
    result = run_suite(model, tokenizer, args.prompts, args.lade_configs, args.repeats, args.max_new_tokens,
                       progress=not args.no_progress)
    close_load_average(machine)
    result = headed(result, machine, interpreter=Path(sys.executable).name, model=str(args.model))
    if args.reference is not None:
        reference = json.loads(args.reference.read_text(encoding="utf-8"))
        result.update(reference=str(args.reference), reference_check=reference_check(result, reference),
                      reference_speedups=reference_speedups(reference))
    publish(result, args.out, format_tables(result))


if __name__ == "__main__":
    main()
