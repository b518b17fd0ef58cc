"""`lookahead serve`: the OpenAI-compatible completion server (see `lookahead.server`)."""

from __future__ import annotations

import ipaddress

import click

from lookahead.cli.options import build_config


@click.command()
@click.option("--model", "model_path", type=click.Path(), default=None,
              help="Local HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. The server has no authentication: keep it on loopback.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--model-name", default=None,
              help="Model id clients send as `model` (default: the model folder/file stem, or "
                   "smollm2-135m-instruct).")
@click.option("--mode", type=click.Choice(["lookahead", "off"]), default="lookahead", show_default=True,
              help="`off` decodes one token per step (no speculation, no suffix cache).")
@click.option("--cache-tokens", type=click.IntRange(min=0), default=1 << 16, show_default=True,
              help="Token budget of the cross-request suffix cache (LRU by request; 0 = off).")
@click.option("--context-length", type=click.IntRange(min=2), default=None,
              help="Prompt + completion cap in tokens (default: the model's max_position_embeddings).")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=1 << 20, show_default=True,
              help="Larger request bodies get HTTP 413.")
@click.option("--max-queue", type=click.IntRange(min=1), default=32, show_default=True,
              help="Generations waiting beyond this get HTTP 503.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for torch (default: torch's choice). On a busy machine 1 can be much faster.")
@click.option("--window-levels", type=click.IntRange(0, 8), default=None, help="Jacobi window levels (0 = off).")
@click.option("--window-columns", type=click.IntRange(1, 64), default=None, help="Jacobi window columns.")
@click.option("--tree-budget", type=click.IntRange(0, 1024), default=None, help="Draft tree nodes per step.")
def serve(model_path, host, port, model_name, mode, cache_tokens, context_length, max_body_bytes, max_queue,
          threads, **knobs) -> None:
    """Serve greedy completions over an OpenAI-compatible HTTP API (POST /v1/completions,
    /v1/chat/completions; GET /v1/models, /health). Requests with temperature > 0 are refused for now."""
    from lookahead.models import ModelLoadError, load_model
    from lookahead.server import ServerSettings, create_app, model_name_for, run_server
    from lookahead.suffix_cache import SuffixCache

    config = build_config(mode, knobs)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    if not _is_loopback(host):
        click.echo(f"lookahead serve: warning: binding {host}, reachable from other machines without "
                   "authentication", err=True)
    try:
        model, tokenizer = load_model(model_path)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        settings = ServerSettings(model_name=model_name or model_name_for(model_path), config=config,
                                  context_length=context_length, max_body_bytes=max_body_bytes, max_queue=max_queue)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    drafts_shared = cache_tokens > 0 and config.tree_budget > 0 and config.shared_candidates > 0
    cache = SuffixCache(max_tokens=cache_tokens) if drafts_shared else None
    app = create_app(model, tokenizer, settings, cache)
    click.echo(f"lookahead serve: model {settings.model_name!r} at http://{host}:{port}/v1", err=True)
    run_server(app, host, port)


def _is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address or `localhost`."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
