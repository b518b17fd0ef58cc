"""Validation of CLI input: prompt text and speculation flags → `LookaheadConfig` (one-line errors)."""

from __future__ import annotations

import click

from lookahead.config import LookaheadConfig


def read_prompt(prompt: str | None, stdin) -> str:
    """Return the prompt from the argument, or from `stdin` when it is omitted or `-`.

    Raises `click.UsageError` for an empty prompt or a missing one with an interactive stdin.
    """
    if prompt is None or prompt == "-":
        if stdin.isatty():
            raise click.UsageError("no prompt: pass PROMPT or pipe text on stdin")
        prompt = stdin.read()
    if not prompt.strip():
        raise click.UsageError("the prompt is empty")
    return prompt


def build_config(mode: str, knobs: dict) -> LookaheadConfig:
    """Build the config for `mode` ('lookahead' | 'off') with the pinned `knobs` (None = default)."""
    if mode == "off":
        return LookaheadConfig.off()
    pinned = {name: value for name, value in knobs.items() if value is not None}
    try:
        return LookaheadConfig().with_overrides(**pinned)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
