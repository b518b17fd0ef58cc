"""`lookahead serve`: the OpenAI-compatible completion server (see `lookahead.server`)."""

from __future__ import annotations

import time

import click

from lookahead.cli.entry import import_model_stack
from lookahead.cli.options import (arithmetic_options, build_config, check_datastore, check_head, datastore_options,
                                   head_options, open_datastore, set_torch_threads, thread_options)
from lookahead.server_bind import allowed_hosts_for, check_bind, check_origin


@click.command()
@click.option("--model", "model_path", type=click.Path(), default=None,
              help="Local HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Anything but loopback needs --api-key.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--model-name", default=None,
              help="Model id clients send as `model` (default: the model folder/file stem, or "
                   "smollm2-135m-instruct).")
@click.option("--mode", type=click.Choice(["lookahead", "off"]), default="lookahead", show_default=True,
              help="`off` decodes one token per step (no speculation, no suffix cache).")
@click.option("--cache-tokens", type=click.IntRange(min=0), default=1 << 16, show_default=True,
              help="Token budget of the cross-request suffix cache (LRU by request; 0 = off).")
@click.option("--prompt-cache-mb", type=click.IntRange(min=0), default=1024, show_default=True,
              help="Memory for the keys and values of the latest texts, reused by a request that starts the same "
                   "way (an edited file, the next chat turn): only the rest of its prompt is forwarded (0 = off).")
@click.option("--context-length", type=click.IntRange(min=2), default=None,
              help="Prompt + completion cap in tokens (default: the model's max_position_embeddings).")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=1 << 20, show_default=True,
              help="Larger request bodies get HTTP 413.")
@click.option("--max-queue", type=click.IntRange(min=1), default=32, show_default=True,
              help="Generations waiting (behind the running one) beyond this get HTTP 503.")
@click.option("--api-key", envvar="LOOKAHEAD_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` (what OpenAI clients send); also $LOOKAHEAD_API_KEY. "
                   "Required for a non-loopback --host.")
@click.option("--allow-origin", "allow_origins", multiple=True, metavar="ORIGIN",
              help="A browser origin (e.g. http://localhost:3000) whose pages may call the server (CORS); "
                   "repeatable. Other cross-origin requests get HTTP 403.")
@click.option("--max-connections", type=click.IntRange(min=1), default=64, show_default=True,
              help="Open connections at most; more are answered 503 and closed.")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True, max=3600), default=10.0,
              show_default=True, help="Seconds a client has to send a complete request (idle, slow headers or "
                                      "body: the connection is closed).")
@click.option("--window-levels", type=click.IntRange(0, 8), default=None, help="Jacobi window levels (0 = off).")
@click.option("--window-columns", type=click.IntRange(1, 64), default=None, help="Jacobi window columns.")
@click.option("--tree-budget", type=click.IntRange(0, 1024), default=None, help="Draft tree nodes per step.")
@head_options
@datastore_options
@arithmetic_options
@thread_options
def serve(model_path, host, port, model_name, mode, cache_tokens, prompt_cache_mb, context_length, max_body_bytes,
          max_queue, api_key, allow_origins, max_connections, request_timeout, threads, datastore, datastore_tokens,
          **knobs) -> None:
    """Serve completions over an OpenAI-compatible HTTP API (POST /v1/completions, /v1/chat/completions;
    GET /v1/models, /health): greedy by default, exact sampling with temperature > 0, reproducible with seed.

    --datastore files go into the cross-request suffix cache (its bound grows by --datastore-tokens); requests
    evict its least recently used documents, files or earlier requests alike (with --cache-tokens 0 requests are
    not cached: the datastore stays as read).

    Only this machine's clients by default: requests must name a loopback Host, browser pages of other origins
    are refused (see --allow-origin), and --api-key guards the rest."""
    config = build_config(mode, knobs)
    check_datastore(datastore, config)
    _check_access(host, api_key, allow_origins)
    import_model_stack()
    from lookahead.server import ServerSettings, model_name_for
    from lookahead.server_http import listening_socket, run_server

    try:
        settings = ServerSettings(model_name=model_name or model_name_for(model_path), config=config,
                                  context_length=context_length, max_body_bytes=max_body_bytes, max_queue=max_queue,
                                  api_key=api_key, allowed_hosts=allowed_hosts_for(host),
                                  allow_origins=tuple(allow_origins), max_connections=max_connections,
                                  request_timeout=request_timeout, cache_requests=cache_tokens > 0,
                                  prompt_cache_bytes=prompt_cache_mb << 20)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        sock = listening_socket(host, port)  # before the model loads: a busy port fails at once
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    with sock:  # closed however this ends (a model that fails to load included)
        app = _build_app(model_path, settings, threads, cache_tokens, datastore, datastore_tokens)
        _warm_up(app.state.engine)
        port = sock.getsockname()[1]  # the port bound (a free one for --port 0)
        click.echo(f"lookahead serve: model {settings.model_name!r} at http://{host}:{port}/v1", err=True)
        try:
            run_server(app, host, port, sock=sock)
        except KeyboardInterrupt:  # uvicorn usually re-raises Ctrl-C once its shutdown is complete ...
            pass  # ... but asyncio's own SIGINT handler may swallow the re-raised signal: it returns normally then
    click.echo("lookahead serve: stopped", err=True)


def _check_access(host: str, api_key: str | None, allow_origins: tuple[str, ...]) -> None:
    """`click.UsageError` for a --host other machines reach without --api-key or an --allow-origin that is not a
    browser origin (checked before torch and transformers import)."""
    try:
        check_bind(host, api_key)
        for origin in allow_origins:
            check_origin(origin)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def _warm_up(engine) -> None:
    """`engine.warm_up()` before the server answers anything (its /health included), with a line on stderr: the
    process's one-time set-up (~1 s for the default model on a 2-core CPU) is not paid by the first request."""
    click.echo("lookahead serve: warming up (a short generation) ...", err=True)
    start = time.perf_counter()
    engine.warm_up()
    click.echo(f"lookahead serve: warmed up in {time.perf_counter() - start:.1f} s", err=True)


def _build_app(model_path, settings, threads: int | None, cache_tokens: int, datastore: tuple[str, ...],
               datastore_tokens: int):
    """The server's app: the model loaded (on `threads` torch threads when given), the cross-request suffix cache
    when requests or a datastore draft from it, the datastore read into it. Raises `click.ClickException` for a
    model that cannot load."""
    from lookahead.models import ModelLoadError, load_model
    from lookahead.server import create_app
    from lookahead.suffix_cache import SuffixCache

    set_torch_threads(threads)
    try:
        model, tokenizer = load_model(model_path)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from exc
    config = settings.config
    check_head(model, config)  # a head file that is not one for this model fails here, not at the first request
    drafts_shared = cache_tokens > 0 and config.tree_budget > 0 and config.shared_candidates > 0
    bound = cache_tokens + (datastore_tokens if datastore else 0)
    cache = SuffixCache(max_tokens=bound) if drafts_shared or datastore else None
    cache = open_datastore(datastore, tokenizer, datastore_tokens, cache)
    return create_app(model, tokenizer, settings, cache)
