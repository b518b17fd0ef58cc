"""`lookahead` command line: `lookahead generate ...`."""

from __future__ import annotations

import sys

import click

from lookahead.cli.build_prior import build_prior
from lookahead.cli.calibrate import calibrate
from lookahead.cli.entry import import_model_stack
from lookahead.cli.options import (arithmetic_options, build_config, check_datastore, datastore_options, draft_choice,
                                   head_options, placement_kwargs, read_prompt, sampling_kwargs, set_torch_threads,
                                   thread_options)
from lookahead.cli.serve import serve
from lookahead.cli.train_head import train_head

INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lookahead-decoding")
def main() -> None:
    """Exact, model-free speculative decoding for Hugging Face transformers."""


@main.command()
@click.argument("prompt", required=False)
@click.option("--model", "model_path", type=click.Path(), default=None,
              help="Local HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--chat/--no-chat", default=False, show_default=True,
              help="Wrap the prompt in the model's chat template.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="New tokens at most; prompt + new tokens must fit the model's context.")
@click.option("--mode", type=click.Choice(["lookahead", "off"]), default="lookahead", show_default=True,
              help="`off` decodes one token per step through the same loop (no speculation).")
@click.option("--stats", is_flag=True, help="Print tokens/s and tokens per step on stderr.")
@click.option("--compare", is_flag=True, help="Also run plain HF greedy and lookahead again, both warm; print "
                                              "the speedup and whether the outputs are identical.")
@click.option("--sample/--greedy", default=False, show_default=True, help="Sample instead of greedy decoding.")
@click.option("--temperature", type=float, default=None, help="Sampling temperature (finite, >= 1e-5).")
@click.option("--top-k", type=click.IntRange(min=0), default=None, help="Sample from the k likeliest tokens.")
@click.option("--top-p", type=float, default=None, help="Nucleus sampling mass, in (0, 1].")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=None,
              help="Reproducible sampling: the same seed gives the same tokens with and without speculation.")
@click.option("--window-levels", type=click.IntRange(0, 8), default=None, help="Jacobi window levels (0 = off).")
@click.option("--window-columns", type=click.IntRange(1, 64), default=None, help="Jacobi window columns.")
@click.option("--tree-budget", type=click.IntRange(0, 1024), default=None, help="Draft tree nodes per step.")
@click.option("--draft-model", "draft_path", type=click.Path(), default=None,
              help="A small model with the same tokenizer that drafts a chain each step (HF folder or .gguf).")
@click.option("--draft-layers", type=click.IntRange(min=1), default=None,
              help="Self-speculative draft: the model's own first N layers plus its LM head.")
@click.option("--draft-tokens", type=click.IntRange(1, 64), default=None, help="Draft-model chain length per step.")
@click.option("--tp", is_flag=True, help="Tensor parallelism over the processes of a torchrun launch "
              "(`torchrun --nproc-per-node N -m lookahead.cli generate --tp ...`); rank 0 prints.")
@click.option("--device-map", default=None, metavar="MAP",
              help='Split the model over devices/CPU/disk (accelerate): "auto" or a JSON object {module: device}.')
@click.option("--offload-folder", type=click.Path(file_okay=False), default=None,
              help='Folder for weights a --device-map puts on "disk".')
@head_options
@datastore_options
@arithmetic_options
@thread_options
def generate(prompt, model_path, chat, max_new_tokens, mode, stats, compare, sample, temperature, top_k, top_p,
             draft_path, draft_layers, tp, device_map, offload_folder, datastore, datastore_tokens, threads,
             **knobs) -> None:
    """Stream a completion of PROMPT (or of stdin when PROMPT is omitted or `-`); greedy unless --sample."""
    text = read_prompt(prompt, sys.stdin)
    config = build_config(mode, knobs)
    check_datastore(datastore, config)
    sampling = sampling_kwargs(sample, temperature, top_k, top_p, knobs.get("seed"))
    if compare and sample:
        raise click.UsageError("--compare checks identity with plain greedy; drop --sample")
    draft = draft_choice(draft_path, draft_layers, mode, knobs.get("draft_tokens"))
    placement = placement_kwargs(tp, device_map, offload_folder)
    import_model_stack()
    set_torch_threads(threads)
    from lookahead.cli.run import run_generate
    from lookahead.distributed import release_process_group

    try:
        run_generate(text, model_path, chat, max_new_tokens, config, stats, compare, sampling, draft, placement,
                     datastore=(datastore, datastore_tokens))
        if tp:
            release_process_group()
    except KeyboardInterrupt:  # the tokens streamed so far stay printed; exit as shells expect after Ctrl-C
        click.echo("\nlookahead: interrupted", err=True)
        raise click.exceptions.Exit(INTERRUPTED_EXIT) from None


main.add_command(serve)
main.add_command(calibrate)
main.add_command(train_head)
main.add_command(build_prior)


if __name__ == "__main__":  # pragma: no cover
    main()
