"""Validation of CLI input: prompt text and speculation flags → `LookaheadConfig` (one-line errors)."""

from __future__ import annotations

import json
import math

import click

from lookahead.config import LookaheadConfig
from lookahead.datastore import DEFAULT_DATASTORE_TOKENS, build_datastore
from lookahead.sampling_bounds import MIN_TEMPERATURE


def read_prompt(prompt: str | None, stdin) -> str:
    """Return the prompt from the argument, or from `stdin` when it is omitted or `-`; both must be UTF-8.

    Raises `click.UsageError` for an empty prompt or a missing one with an interactive stdin, and
    `click.ClickException` for bytes that are not UTF-8 (nothing is replaced: the model sees what was sent).
    """
    if prompt is None or prompt == "-":
        if stdin.isatty():
            raise click.UsageError("no prompt: pass PROMPT or pipe text on stdin")
        buffer = getattr(stdin, "buffer", None)
        prompt = stdin.read() if buffer is None else _utf8(buffer.read(), "stdin")
    else:
        # POSIX hands undecodable argument bytes over as lone surrogates (PEP 383); get the bytes back.
        try:
            raw = prompt.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError as exc:
            raise click.ClickException(f"PROMPT is not valid UTF-8 text (character {exc.start})") from None
        prompt = _utf8(raw, "PROMPT")
    if not prompt.strip():
        raise click.UsageError("the prompt is empty")
    return prompt


def _utf8(data: bytes, source: str) -> str:
    """`data` decoded as UTF-8; `click.ClickException` naming the first bad byte and its offset otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise click.ClickException(f"{source} is not valid UTF-8: byte 0x{data[exc.start]:02x} at offset "
                                   f"{exc.start}; pass UTF-8 text (e.g. convert with iconv)") from None


def sampling_kwargs(sample: bool, temperature: float | None, top_k: int | None, top_p: float | None,
                    seed: int | None = None) -> dict:
    """`generate` kwargs for the sampling flags; raises `click.UsageError` for out-of-range values or
    sampling flags (a seed included: greedy output has nothing to seed) given without --sample."""
    given = {name: value for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
             if value is not None}
    if not sample:
        if given or seed is not None:
            flag = next(iter(given)) if given else "seed"
            raise click.UsageError(f"--{flag.replace('_', '-')} needs --sample")
        return {"do_sample": False}
    if temperature is not None and not (temperature >= MIN_TEMPERATURE and math.isfinite(temperature)):
        raise click.UsageError(f"--temperature must be finite and >= {MIN_TEMPERATURE}, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise click.UsageError(f"--top-p must be in (0, 1], got {top_p}")
    return {"do_sample": True, **given}


# Knobs that keep their value with `--mode off`: the seed (so `--mode off --seed S` reproduces a speculative run)
# and the arithmetic (so the plain loop computes exactly as the speculative one does).
BOTH_MODES = ("seed", "attention", "packed_linear", "amx_kernel")


def arithmetic_options(command):
    """Add `--attention`, `--packed/--no-packed` and `--amx/--no-amx` (the knobs `attention`, `packed_linear`,
    `amx_kernel`) to a command."""
    command = click.option("--amx/--no-amx", "amx_kernel", default=None,
                           help="4-bit and 8-bit block weights on the AMX kernels where the CPU has AMX (default: "
                                "on; --no-amx keeps the streamed kernel).")(command)
    command = click.option("--packed/--no-packed", "packed_linear", default=None,
                           help="Linear layers on oneDNN-prepacked weights during generation (default: on; CPU, "
                                "fp32).")(command)
    return click.option("--attention", type=click.Choice(["auto", "sdpa", "triton"]), default=None,
                        help="auto (default): the lookahead_tree backend when the model uses SDPA (CPU: grouped "
                             "SDPA; CUDA: the Triton tree kernel); sdpa: the model's own; triton: CUDA only.")(command)


def thread_options(command):
    """Add `--threads` (CPU threads, passed on as `threads`) and `--adapt-threads/--fixed-threads` (the knob
    `adapt_threads`) to a command."""
    command = click.option("--adapt-threads/--fixed-threads", "adapt_threads", default=None,
                           help="Run steps on fewer threads while other processes hold the cores, on all again once "
                                "they leave (default: adapt; outputs do not change).")(command)
    return click.option("--threads", type=click.IntRange(min=1), default=None,
                        help="CPU threads for torch and lookahead's kernels (default: torch's choice).")(command)


def set_torch_threads(threads: int | None) -> None:
    """Run torch (and, through the generations, lookahead's numba kernels) on `threads` threads when given."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def head_options(command):
    """Add `--draft-head FILE`, `--head-candidates N`, `--recycle-prior` and `--recycle-pairs/--no-recycle-pairs`
    (the knobs `draft_head`, `head_candidates`, `recycle_prior`, `recycle_pairs`) to a command."""
    command = click.option("--recycle-pairs/--no-recycle-pairs", "recycle_pairs", default=None,
                           help="Keep token recycling's rows per token pair too and draft from them (default: off). "
                                "Outputs do not change.")(command)
    command = click.option("--recycle-prior", metavar="auto|none|FILE", default=None,
                           help="Seed token recycling's table with what the model chooses after each token in its "
                                "own text: auto (default) = the prior shipped for the model, none, or a file from "
                                "`lookahead build-prior`. Outputs do not change.")(command)
    command = click.option("--head-candidates", type=click.IntRange(0, 16), default=None,
                           help="Tokens the learned draft head proposes after the root each step (0 = off).")(command)
    return click.option("--draft-head", metavar="auto|FILE", default=None,
                        help="Add the learned draft head: auto = the one shipped for the model, or a file from "
                             "`lookahead train-head`. Outputs do not change.")(command)


def check_head(model, config: LookaheadConfig):
    """Load the draft head and the recycling prior `config` asks for, for `model` (so a bad file fails before the
    first generation); raises `click.ClickException` for a file that is not a head or a prior for this model."""
    from lookahead.head_files import configured_head
    from lookahead.recycle_prior import configured_prior

    try:
        configured_head(model, config)
        configured_prior(model, config)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc


def datastore_options(command):
    """Add `--datastore PATH` (repeatable) and `--datastore-tokens N` to a command."""
    command = click.option("--datastore-tokens", type=click.IntRange(min=1), default=DEFAULT_DATASTORE_TOKENS,
                           show_default=True, help="Tokens the datastore holds at most.")(command)
    return click.option("--datastore", "datastore", multiple=True, type=click.Path(exists=True),
                        help="Text file or folder (walked recursively) whose continuations draft, e.g. a code "
                             "base; repeatable. Outputs do not change.")(command)


def check_datastore(paths: tuple[str, ...], config: LookaheadConfig) -> None:
    """Raise `click.UsageError` when --datastore is given but nothing would draft from it (`--mode off`, a zero
    tree budget); call before loading the model."""
    if paths and (config.tree_budget == 0 or config.shared_candidates == 0):
        raise click.UsageError("--datastore drafts, but speculation is off: drop --mode off / --tree-budget 0")


def open_datastore(paths: tuple[str, ...], tokenizer, max_tokens: int, cache=None):
    """The `SuffixCache` of the --datastore `paths` (`cache` as it is when none is given), filled into `cache` if
    given; reports what was read on stderr. Raises `click.ClickException` for paths without UTF-8 text."""
    if not paths:
        return cache
    try:
        cache, report = build_datastore(list(paths), tokenizer, max_tokens, cache=cache, progress=True)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"[lookahead] {report.summary()}", err=True)
    return cache


def build_config(mode: str, knobs: dict) -> LookaheadConfig:
    """Build the config for `mode` ('lookahead' | 'off') with the pinned `knobs` (None = default); the knobs of
    BOTH_MODES apply with `off` too. Raises `click.UsageError` for a bad value or a knob that would do nothing."""
    pinned = {name: value for name, value in knobs.items() if value is not None}
    if "head_candidates" in pinned and "draft_head" not in pinned:
        raise click.UsageError("--head-candidates sets the learned head's proposals: add --draft-head")
    if "window_columns" in pinned and not pinned.get("window_levels"):
        raise click.UsageError("--window-columns sets the Jacobi window's width: add --window-levels N "
                               "(the window is off by default)")
    if mode == "off":
        pinned = {name: value for name, value in pinned.items() if name in BOTH_MODES}
    try:
        return (LookaheadConfig.off() if mode == "off" else LookaheadConfig()).with_overrides(**pinned)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def draft_choice(path: str | None, layers: int | None, mode: str,
                 draft_tokens: int | None = None) -> tuple[str, str | int] | None:
    """("model", path), ("layers", n) or None from --draft-model / --draft-layers; raises `click.UsageError`
    when both are given, when speculation is off, or when --draft-tokens is given without a draft model."""
    if path is not None and layers is not None:
        raise click.UsageError("--draft-model and --draft-layers exclude each other; pick one draft")
    if path is None and layers is None:
        if draft_tokens is not None:
            raise click.UsageError("--draft-tokens sets a draft model's chain: add --draft-model or --draft-layers")
        return None
    if mode == "off":
        raise click.UsageError("a draft model needs speculation: drop --mode off")
    return ("model", path) if path is not None else ("layers", layers)


def placement_kwargs(tp: bool, device_map: str | None, offload_folder: str | None) -> dict:
    """`load_model` keyword arguments for --tp / --device-map / --offload-folder; `click.UsageError` for a
    device map that is neither "auto"-like nor a JSON object, or for flags that do not go together."""
    if tp and device_map is not None:
        raise click.UsageError("--tp and --device-map cannot be combined")
    if offload_folder is not None and device_map is None:
        raise click.UsageError('--offload-folder needs a --device-map that puts layers on "disk"')
    placement = {"tp_plan": "auto"} if tp else {}
    if device_map is not None:
        placement["device_map"] = _device_map(device_map)
    if offload_folder is not None:
        placement["offload_folder"] = offload_folder
    return placement


def _device_map(text: str) -> str | dict:
    """A device map given on the command line: a strategy name or a JSON object of module → device."""
    if text in ("auto", "balanced", "balanced_low_0", "sequential"):
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise click.UsageError('--device-map: expected "auto" (or balanced, sequential) or a JSON object such '
                               'as \'{"model.layers.0": "cpu", "lm_head": "disk"}\'')
    return value
