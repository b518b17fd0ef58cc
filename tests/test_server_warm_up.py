"""The server's warm-up: `Engine.warm_up` generates greedy and sampled outside every request and keeps nothing, and
`lookahead serve` runs it before it answers anything."""

from __future__ import annotations

import types

import torch
from click.testing import CliRunner
from server_helpers import one_thread  # noqa: F401  (autouse fixture)
from tiny_models import build_tiny_model

from lookahead import load_model
from lookahead.cli import serve as serve_command
from lookahead.cli.main import main
from lookahead.server import ServerSettings, create_app
from lookahead.server_engine import WARM_UP_TOKENS
from lookahead.suffix_cache import SuffixCache


def _engine():
    """An engine for a tiny random model with the default tokenizer, a suffix cache and a prompt cache."""
    _, tokenizer = load_model()
    model = build_tiny_model(vocab=len(tokenizer), dtype=torch.float64)
    app = create_app(model, tokenizer, ServerSettings(model_name="tiny"), SuffixCache(max_tokens=4096))
    return app.state.engine


def test_warm_up_generates_greedy_and_sampled_and_keeps_nothing(monkeypatch):
    engine = _engine()
    calls, generate = [], engine.model.generate

    def spy(*args, **kwargs):
        output = generate(*args, **kwargs)
        calls.append((kwargs, output.shape[1] - args[0].shape[1]))
        return output

    monkeypatch.setattr(engine.model, "generate", spy)
    engine.recycle_table.ensure(engine.vocab_size, engine.config.recycle_k)
    table = engine.recycle_table.table.copy()
    engine.warm_up()
    assert [kwargs["do_sample"] for kwargs, _ in calls] == [False, True]
    assert all(new == WARM_UP_TOKENS for _, new in calls)
    assert all(kwargs["custom_generate"].recycle_table is not engine.recycle_table for kwargs, _ in calls)
    assert (engine.recycle_table.table == table).all()  # the requests' table learned nothing from it
    assert len(engine.cache) == 0 and engine.prompt_cache.info()["texts"] == 0
    assert engine.last_completion is None
    engine.close()


def test_serve_warms_up_before_it_serves(monkeypatch):
    order = []
    engine = types.SimpleNamespace(warm_up=lambda: order.append("warm up"))
    app = types.SimpleNamespace(state=types.SimpleNamespace(engine=engine))
    monkeypatch.setattr(serve_command, "_build_app", lambda *args: app)
    monkeypatch.setattr("lookahead.server_http.run_server", lambda *args, **kwargs: order.append("serve"))
    result = CliRunner().invoke(main, ["serve", "--port", "0"])
    assert result.exit_code == 0, result.output
    assert order == ["warm up", "serve"]
    assert "lookahead serve: warmed up in" in result.output
