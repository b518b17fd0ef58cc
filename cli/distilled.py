"""The self-distilled texts `lookahead train-head` and `lookahead build-prior` learn from: read from a `--data` file
of an earlier run, or written by the model itself (`head_training.distill`) and kept there."""

from __future__ import annotations

from pathlib import Path

import click

from lookahead.cli.entry import import_model_stack

DTYPES = ("bfloat16", "float32")  # --distill-dtype's choices, named as torch names them


def distill_options(min_sequences: int):
    """Add what both commands take to a command: the OUT argument, --model, --sequences (at least
    `min_sequences`), --batch, --distill-dtype, --data and --seed."""
    def add(command):
        for option in reversed([
            click.argument("out", type=click.Path(dir_okay=False, writable=True)),
            click.option("--model", "model_path", type=click.Path(), default=None,
                         help="Local HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)."),
            click.option("--sequences", type=click.IntRange(min=min_sequences), default=4096, show_default=True,
                         help="Texts the model writes (chat answers, answers about passages, continuations)."),
            click.option("--batch", type=click.IntRange(min=1), default=32, show_default=True,
                         help="Texts generated together while distilling."),
            click.option("--distill-dtype", type=click.Choice(DTYPES), default=None,
                         help="Write the texts with a copy of the model in this dtype (default: the model's own). "
                              "bfloat16 is faster on a CPU with AMX or AVX-512 BF16 (use a larger --batch, 128); "
                              "its labels agree with float32's argmax at ~98% of positions."),
            click.option("--data", type=click.Path(dir_okay=False), default=None,
                         help="Keep the distilled texts in this file; an existing file is reused instead of "
                              "distilling again."),
            click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)]):
            command = option(command)
        return command
    return add


def model_for(out: str, model_path: str | None):
    """(model, tokenizer) of `model_path` for a command writing `out`; `click` errors for a missing output folder
    or a model that does not load."""
    if not Path(out).parent.is_dir():
        raise click.UsageError(f"OUT: folder {Path(out).parent} does not exist")
    import_model_stack()
    from lookahead.models import ModelLoadError, load_model

    try:
        return load_model(model_path)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from exc


def distilled_texts(model, tokenizer, data: str | None, sequences: int, batch: int, seed: int,
                    dtype: str | None = None) -> list:
    """The texts in the file `data` when it exists, else `sequences` texts distilled from the model (written in
    `dtype`, a name in `DTYPES`, when given; kept in `data` when given); progress on stderr. Raises
    `click.ClickException` for an unreadable file or a model that cannot write them."""
    import torch

    from lookahead.head_training import distill

    if data is not None and Path(data).is_file():
        texts = _read_examples(data)
        report(f"read {len(texts)} distilled texts from {data}")
        return texts
    try:
        texts = distill(model, tokenizer, sequences, seed=seed, batch=batch, progress=report,
                        dtype=None if dtype is None else getattr(torch, dtype))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    if data is not None:
        torch.save([vars(e) for e in texts], data)
    return texts


def report(line: str) -> None:
    """A progress line on stderr."""
    click.echo(f"[lookahead] {line}", err=True)


def _read_examples(path: str):
    """The distilled texts saved by an earlier run with --data; `click.ClickException` when the file is not one."""
    import torch

    from lookahead.head_training import Example

    try:
        return [Example(**entry) for entry in torch.load(path)]
    except Exception as exc:  # noqa: BLE001 — any unreadable file is reported the same way
        raise click.ClickException(f"--data {path} is not a file of distilled texts ({exc})") from None
