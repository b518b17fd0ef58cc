"""`lookahead generate`: load, stream the completion, report stats and the comparison on stderr."""

from __future__ import annotations

import os
import time

import click
import torch

from lookahead.cli.options import check_head, open_datastore
from lookahead.cli.streaming import PipedStreamer, ReaderGone
from lookahead.config import LookaheadConfig
from lookahead.hf import Lookahead
from lookahead.models import ModelLoadError, load_draft, load_model


def run_generate(text: str, model_path: str | None, chat: bool, max_new_tokens: int, config: LookaheadConfig,
                 stats: bool, compare: bool, sampling: dict, draft: tuple | None = None,
                 placement: dict | None = None, datastore: tuple[tuple[str, ...], int] = ((), 1)) -> None:
    """Generate (greedy, or sampled per `sampling` kwargs), streaming to stdout; `draft` is the
    `options.draft_choice`, `placement` the `options.placement_kwargs` (under tensor parallelism only rank 0
    prints), `datastore` the --datastore paths and token bound. Errors become one-line `click.ClickException`s."""
    try:
        model, tokenizer = load_model(model_path, **(placement or {}))
    except (ModelLoadError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        draft_model = _load_draft(model, tokenizer, draft)
    except (ModelLoadError, ValueError) as exc:
        raise click.ClickException(f"draft model: {exc}") from exc
    check_head(model, config)
    input_ids = _encode(tokenizer, text, chat)
    _check_context(model, input_ids.shape[1], max_new_tokens)
    paths, max_tokens = datastore
    shared = open_datastore(paths, tokenizer, max_tokens)
    decoder = Lookahead(config, draft_model=draft_model, shared_drafter=shared)
    speaks = int(os.environ.get("RANK", "0")) == 0  # tensor-parallel ranks compute alike; rank 0 prints
    streamer = PipedStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if speaks else None
    try:
        output = model.generate(input_ids, max_new_tokens=max_new_tokens, custom_generate=decoder,
                                lookahead_streamer=streamer, **sampling)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    except ReaderGone:
        if stats:
            click.echo(f"[lookahead] stopped when the output's reader closed it; {decoder.last_stats.summary()}",
                       err=True)
        return
    except KeyboardInterrupt:  # `main` then says so and exits 130
        if stats and speaks and decoder.last_stats is not None:
            click.echo(f"\n[lookahead] {decoder.last_stats.summary()}", err=True)
        raise
    if stats and speaks:
        click.echo(f"[lookahead] {decoder.last_stats.summary()}", err=True)
    if compare:  # with greedy decoding only (`main.generate` refuses --compare --sample)
        again = Lookahead(config, draft_model=draft_model, shared_drafter=shared)  # fresh drafters, warm model
        _compare(model, input_ids, max_new_tokens, output, again, decoder.last_stats.total_time, speaks)


def _load_draft(model, tokenizer, draft: tuple | None):
    """The draft model of `draft` (None, ("model", path) or ("layers", n)); see `models.load_draft`."""
    if draft is None:
        return None
    kind, value = draft
    return load_draft(model, tokenizer, path=value if kind == "model" else None,
                      layers=value if kind == "layers" else None)


def _encode(tokenizer, text: str, chat: bool) -> torch.Tensor:
    """Token ids [1, L] of the prompt, through the chat template when `chat`."""
    if chat:
        if not tokenizer.chat_template:
            raise click.ClickException("--chat: this model's tokenizer has no chat template; use --no-chat")
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt").input_ids


def _check_context(model, n_prompt: int, max_new_tokens: int) -> None:
    """The server's rule: prompt + new tokens must fit the model's context (`max_position_embeddings`);
    `click.ClickException` naming the numbers otherwise (before anything is allocated for the generation)."""
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if context is None:
        return
    if n_prompt >= context:
        raise click.ClickException(f"the prompt has {n_prompt} tokens; the model's context is {context} tokens")
    if n_prompt + max_new_tokens > context:
        raise click.ClickException(f"--max-new-tokens: {n_prompt} prompt tokens + {max_new_tokens} new tokens "
                                   f"exceed the model's context of {context} tokens (at most "
                                   f"{context - n_prompt} new tokens fit)")


def _compare(model, input_ids: torch.Tensor, max_new_tokens: int, output: torch.Tensor, decoder: Lookahead,
             first_seconds: float, speaks: bool = True) -> None:
    """Run plain HF greedy, then lookahead again with `decoder` (fresh drafters, so it cannot draft from the first
    run's output), on the same input (on every tensor-parallel rank), and print on stderr (if `speaks`) both
    warm times, the speedup, whether all outputs are identical, and the streamed first call's time: that call
    also paid one-time set-up (packing the weights, loading cached measurements, compiling the drafters)."""
    start = time.perf_counter()
    plain = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
    plain_seconds = time.perf_counter() - start
    again = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, custom_generate=decoder)
    seconds = decoder.last_stats.total_time
    if not speaks:
        return
    identical = torch.equal(plain, output) and torch.equal(plain, again)
    new = output.shape[1] - input_ids.shape[1]
    click.echo(f"[compare] plain greedy {plain_seconds:.2f} s, lookahead {seconds:.2f} s for {new} tokens: "
               f"speedup {plain_seconds / seconds:.2f}x, outputs identical: {'yes' if identical else 'NO'} "
               f"(both timed warm; the streamed first call took {first_seconds:.2f} s with one-time set-up)",
               err=True)
