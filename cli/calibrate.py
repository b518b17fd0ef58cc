"""`lookahead calibrate`: measure (or show the cached) verification cost curve and the budget it implies."""

from __future__ import annotations

import click
import numpy as np

from lookahead.cli.entry import import_model_stack

CHAIN = 8  # draft-chain length used to illustrate the chosen budget


@click.command()
@click.option("--model", "model_path", type=click.Path(), default=None,
              help="Local HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--refresh", is_flag=True, help="Measure again even if a cached curve exists.")
@click.option("--packed/--no-packed", default=True, show_default=True,
              help="Measure with the linear layers on prepacked oneDNN weights (what generation uses by default).")
@click.option("--amx/--no-amx", default=True, show_default=True,
              help="Measure with 4-bit and 8-bit block weights on the AMX kernels where the CPU has AMX (what "
                   "generation uses by default).")
@click.option("--attention", type=click.Choice(["auto", "sdpa", "triton"]), default="auto", show_default=True,
              help="Attention during generation (see `lookahead generate --help`).")
def calibrate(model_path, refresh, packed, amx, attention) -> None:
    """Print t(k)/t(1) for verifying k rows (at each measured cache length) and how many draft tokens a step
    verifies at each acceptance rate."""
    import_model_stack()
    from lookahead.budget import best_row_count
    from lookahead.calibration import cost_curve_for
    from lookahead.models import ModelLoadError, load_model
    from lookahead.config import LookaheadConfig
    from lookahead.hf import generation_arithmetic

    try:
        model, _ = load_model(model_path)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        config = LookaheadConfig(packed_linear=packed, amx_kernel=amx, attention=attention)
        with generation_arithmetic(model, config, refresh=refresh) as arithmetic:
            curve = cost_curve_for(model, refresh=refresh)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    note = " — a conservative default: the measurement stayed implausible" if curve.source == "default" else ""
    click.echo(f"one-row step: {curve.base_seconds * 1000:.1f} ms; {arithmetic}{note}")
    click.echo(f"{'rows k':>18} " + " ".join(f"{k:>6d}" for k in curve.sizes))
    for length, ratios in ((curve.prefix_len, curve.ratios),) + curve.by_context:
        click.echo(f"{f't(k)/t(1) @ {length}':>18} " + " ".join(f"{r:>6.2f}" for r in ratios))
    for rate in (0.3, 0.5, 0.7, 0.9):
        probs = rate ** np.arange(1, CHAIN + 1)
        k, _ = best_row_count(probs, 0, 0.0, curve)
        gain = 1 + probs[:k].sum()
        click.echo(f"acceptance {rate:.1f}: verify {k} draft tokens -> expected {gain:.2f} tokens/step, "
                   f"{gain / curve.ratio(1 + k):.2f}x a plain step")
