"""`lookahead build-prior`: make a recycling prior for a model from its own text (`recycle_prior.py`)."""

from __future__ import annotations

import click

from lookahead.cli.distilled import distill_options, distilled_texts, model_for


@click.command("build-prior")
@distill_options(min_sequences=1)
@click.option("--k", "k", type=click.IntRange(1, 64), default=8, show_default=True,
              help="Predicted next tokens kept per token.")
@click.option("--pair-k", type=click.IntRange(0, 64), default=4, show_default=True,
              help="Predicted next tokens kept per token pair (0: no rows per pair).")
@click.option("--min-count", type=click.IntRange(min=1), default=2, show_default=True,
              help="Occurrences of a token (or a token pair) in the texts before it gets a row.")
def build_prior(out, model_path, sequences, k, pair_k, min_count, batch, distill_dtype, data, seed) -> None:
    """Count what the model chooses after each token in texts it writes itself and write the counts to OUT
    (.safetensors) as a recycling prior. Pass it with `lookahead generate --recycle-prior OUT`; priors shipped in
    lookahead/priors/ are used automatically."""
    model, tokenizer = model_for(out, model_path)
    from lookahead.recycle_prior import build_prior as count, save_prior

    texts = distilled_texts(model, tokenizer, data, sequences, batch, seed, distill_dtype)
    try:
        prior = count(texts, model.config.get_text_config().vocab_size, k=k, min_count=min_count, pair_k=pair_k)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    positions = sum(len(text.ids) for text in texts)
    how = (f"lookahead build-prior: {len(texts)} self-distilled texts ({positions} positions), top {k} per token "
           f"and {pair_k} per token pair, seen at least {min_count} times: {len(prior.tokens)} token rows, "
           f"{len(prior.pair_tokens)} pair rows")
    save_prior(out, prior, model, how)
    click.echo(f"wrote {out}: {how}")
