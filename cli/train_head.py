"""`lookahead train-head`: make a learned draft head for a model from its own text (`head_training.py`)."""

from __future__ import annotations

from pathlib import Path

import click

from lookahead.cli.distilled import distill_options, distilled_texts, model_for, report


@click.command("train-head")
@distill_options(min_sequences=2)
@click.option("--epochs", type=click.IntRange(min=1), default=6, show_default=True, help="Passes over the texts.")
@click.option("--vocab", "vocab_size", type=click.IntRange(min=2), default=8192, show_default=True,
              help="Output tokens of the head: those the model chooses most often in the texts.")
@click.option("--init", "init", type=click.Path(dir_okay=False), default=None,
              help="Train on from this head file (made for the same model; its sizes and output tokens are kept).")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=1e-3, show_default=True,
              help="Peak learning rate of the one-cycle schedule (train on from --init with a smaller one, 3e-4).")
def train_head(out, model_path, sequences, epochs, vocab_size, batch, distill_dtype, data, init, lr, seed) -> None:
    """Distill texts from the model itself, fit a draft head on them and write it to OUT (.safetensors). Pass it
    with `lookahead generate --draft-head OUT`; heads shipped in lookahead/heads/ are found automatically."""
    model, tokenizer = model_for(out, model_path)
    from lookahead.head_files import read_head, save_head
    from lookahead.head_training import fit, head_weights

    try:
        start = None if init is None else read_head(init, model)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--init") from None
    examples = distilled_texts(model, tokenizer, data, sequences, batch, seed, distill_dtype)
    net, vocab, result = fit(examples, model.get_input_embeddings().weight, vocab_size=vocab_size, epochs=epochs,
                             lr=lr, seed=seed, start=start, progress=report)
    how = (f"lookahead train-head: {len(examples)} self-distilled texts ({result['positions']} positions), "
           f"{epochs} epochs{' from ' + Path(init).name if init else ''}, {len(vocab)} output tokens, "
           f"held-out top-1 {result['top1'][-1]:.3f}")
    save_head(out, head_weights(net), vocab, model, how)
    click.echo(f"wrote {out}: {how}")
