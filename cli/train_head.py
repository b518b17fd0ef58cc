"""`lookahead train-head`: make a learned draft head for a model from its own text (`head_training.py`)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("train-head")
@click.argument("out", type=click.Path(dir_okay=False, writable=True))
@click.option("--model", "model_path", type=click.Path(), default=None,
              help="Local HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--sequences", type=click.IntRange(min=2), default=4096, show_default=True,
              help="Texts the model writes for training (chat answers, answers about passages, continuations).")
@click.option("--epochs", type=click.IntRange(min=1), default=6, show_default=True, help="Passes over the texts.")
@click.option("--vocab", "vocab_size", type=click.IntRange(min=2), default=8192, show_default=True,
              help="Output tokens of the head: those the model chooses most often in the texts.")
@click.option("--batch", type=click.IntRange(min=1), default=32, show_default=True,
              help="Texts generated together while distilling.")
@click.option("--data", type=click.Path(dir_okay=False), default=None,
              help="Keep the distilled texts in this file; an existing file is reused instead of distilling again.")
@click.option("--init", "init", type=click.Path(dir_okay=False), default=None,
              help="Train on from this head file (made for the same model; its sizes and output tokens are kept).")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=1e-3, show_default=True,
              help="Peak learning rate of the one-cycle schedule (train on from --init with a smaller one, 3e-4).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
def train_head(out, model_path, sequences, epochs, vocab_size, batch, data, init, lr, seed) -> None:
    """Distill texts from the model itself, fit a draft head on them and write it to OUT (.safetensors). Pass it
    with `lookahead generate --draft-head OUT`; heads shipped in lookahead/heads/ are found automatically."""
    import torch

    from lookahead.head_files import read_head, save_head
    from lookahead.head_training import distill, fit, head_weights
    from lookahead.models import ModelLoadError, load_model

    if not Path(out).parent.is_dir():
        raise click.UsageError(f"OUT: folder {Path(out).parent} does not exist")
    try:
        model, tokenizer = load_model(model_path)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        start = None if init is None else read_head(init, model)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--init") from None
    if data is not None and Path(data).is_file():
        examples = _read_examples(data)
        report(f"read {len(examples)} distilled texts from {data}")
    else:
        try:
            examples = distill(model, tokenizer, sequences, seed=seed, batch=batch, progress=report)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
        if data is not None:
            torch.save([vars(e) for e in examples], data)
    net, vocab, result = fit(examples, model.get_input_embeddings().weight, vocab_size=vocab_size, epochs=epochs,
                             lr=lr, seed=seed, start=start, progress=report)
    how = (f"lookahead train-head: {len(examples)} self-distilled texts ({result['positions']} positions), "
           f"{epochs} epochs{' from ' + Path(init).name if init else ''}, {len(vocab)} output tokens, "
           f"held-out top-1 {result['top1'][-1]:.3f}")
    save_head(out, head_weights(net), vocab, model, how)
    click.echo(f"wrote {out}: {how}")


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
