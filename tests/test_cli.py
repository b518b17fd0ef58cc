"""`lookahead generate`: streams the same text plain greedy produces; bad input gives a one-line error."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from tiny_models import build_tiny_model as tiny_model
from transformers import AutoTokenizer

from lookahead.cli.main import main
from lookahead.head_files import read_metadata, save_head
from lookahead.head_training import HeadNet, head_weights
from lookahead.models import default_model_folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama with the default model's real tokenizer, saved as a local HF folder."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_folder())
    model = tiny_model("llama", dtype=torch.float32, seed=5, vocab=len(tokenizer))
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


def _run(*args, stdin=None):
    return CliRunner().invoke(main, ["generate", *args], input=stdin)


def test_generate_streams_plain_greedy_text(tiny_folder):
    folder, model, tokenizer = tiny_folder
    prompt = "def fibonacci(n):"
    result = _run(prompt, "--model", str(folder), "--max-new-tokens", "24")
    assert result.exit_code == 0, result.output
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    plain = model.generate(ids, max_new_tokens=24, do_sample=False)
    expected = tokenizer.decode(plain[0, ids.shape[1]:], skip_special_tokens=True)
    assert result.stdout.strip() == expected.strip()


def test_generate_stops_quietly_when_the_reader_of_its_output_is_gone(tiny_folder):
    """`lookahead generate ... | head`: the pipe's reader exits; the command stops, says so with its stats, status 0."""
    folder, _, _ = tiny_folder
    command = [sys.executable, "-m", "lookahead.cli", "generate", "def fibonacci(n):", "--model", str(folder),
               "--max-new-tokens", "64", "--stats", "--mode", "off"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # gone before the first token is printed
    stderr = process.stderr.read()
    assert process.wait(timeout=300) == 0, stderr
    assert "stopped when the output's reader closed it" in stderr and "tokens/step" in stderr
    assert "Traceback" not in stderr and "Broken pipe" not in stderr


def test_generate_interrupted_reports_its_stats_so_far(tiny_folder, monkeypatch):
    """Ctrl-C while tokens stream: the --stats line of what was done (the first token: the interrupted print's),
    then the one-line notice and status 130."""
    from lookahead.cli import streaming

    def interrupt(self, text, stream_end=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(streaming.PipedStreamer, "on_finalized_text", interrupt)
    folder, _, _ = tiny_folder
    result = _run("def fibonacci(n):", "--model", str(folder), "--max-new-tokens", "64", "--stats")
    assert result.exit_code == 130 and result.stderr.endswith("\nlookahead: interrupted\n")
    assert "[lookahead] 1 token in " in result.stderr and "Traceback" not in result.output


def test_generate_reads_stdin_and_reports_stats_and_comparison(tiny_folder):
    folder, _, _ = tiny_folder
    result = _run("--model", str(folder), "--max-new-tokens", "16", "--stats", "--compare",
                  stdin="import numpy as np\n")
    assert result.exit_code == 0, result.output
    assert "tokens/step" in result.stderr and "tok/s" in result.stderr
    assert "outputs identical: yes" in result.stderr and "both timed warm" in result.stderr


def test_compare_times_a_second_lookahead_run_with_fresh_drafters(tiny_folder, monkeypatch):
    """The speedup compares warm runs: lookahead runs again after plain greedy, with a new `Lookahead` (a reused
    one would draft from its recycling table of the first run's own output)."""
    import functools

    from lookahead import hf

    decoders = []
    original = hf.Lookahead.__call__

    @functools.wraps(original)  # generate reads the callable's parameters (lookahead_streamer)
    def spy(self, *args, **kwargs):
        decoders.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(hf.Lookahead, "__call__", spy)
    folder, _, _ = tiny_folder
    result = _run("def f(x):", "--model", str(folder), "--max-new-tokens", "12", "--compare")
    assert result.exit_code == 0, result.output
    assert len(decoders) == 2 and decoders[0] is not decoders[1]
    assert decoders[0].recycle_table is not decoders[1].recycle_table


def test_mode_off_gives_the_same_text(tiny_folder):
    folder, _, _ = tiny_folder
    on = _run("x = [1, 2, 3]", "--model", str(folder), "--max-new-tokens", "16")
    off = _run("x = [1, 2, 3]", "--model", str(folder), "--max-new-tokens", "16", "--mode", "off", "--stats")
    assert on.exit_code == off.exit_code == 0
    assert on.stdout == off.stdout
    assert "1.00 tokens/step" in off.stderr


def test_seeded_sampling_matches_mode_off(tiny_folder):
    folder, _, _ = tiny_folder
    args = ["def f(x):", "--model", str(folder), "--max-new-tokens", "24", "--sample", "--seed", "11",
            "--temperature", "0.9"]
    on, off = _run(*args), _run(*args, "--mode", "off")
    other = _run(*args[:-3], "12", "--temperature", "0.9")
    assert on.exit_code == off.exit_code == other.exit_code == 0
    assert on.stdout == off.stdout
    assert other.stdout != on.stdout


@pytest.mark.parametrize("args, stdin, message", [
    (["   "], None, "prompt is empty"),
    (["hi", "--model", "/no/such/model"], None, "does not exist"),
    (["hi", "--max-new-tokens", "0"], None, "max-new-tokens"),
    (["hi", "--max-new-tokens", "many"], None, "max-new-tokens"),
    (["hi", "--mode", "fast"], None, "mode"),
    (["hi", "--tree-budget", "-3"], None, "tree-budget"),
    ([], "", "prompt is empty"),
    (["hi", "--sample", "--temperature", "-1"], None, "--temperature must be finite and >= 1e-05, got -1.0"),
    (["hi", "--sample", "--temperature", "inf"], None, "--temperature must be finite and >= 1e-05, got inf"),
    (["hi", "--sample", "--temperature", "nan"], None, "--temperature must be finite and >= 1e-05, got nan"),
    (["hi", "--sample", "--temperature", "1e-300"], None, "--temperature must be finite and >= 1e-05"),
    (["hi", "--sample", "--top-p", "nan"], None, "top-p must be in (0, 1]"),
    ([], b"caf\xe9", "stdin is not valid UTF-8: byte 0xe9 at offset 3"),
    (["-"], b"ok \xff\xfe", "stdin is not valid UTF-8: byte 0xff at offset 3"),
    (["caf\udce9"], None, "PROMPT is not valid UTF-8: byte 0xe9 at offset 3"),  # how Python hands over argv bytes
    (["caf\ud800"], None, "PROMPT is not valid UTF-8 text"),
    (["hi", "--sample", "--top-p", "1.5"], None, "top-p must be in (0, 1]"),
    (["hi", "--top-k", "5"], None, "needs --sample"),
    (["hi", "--seed", "-2"], None, "seed"),
    (["hi", "--draft-model", "x", "--draft-layers", "1"], None, "exclude each other"),
    (["hi", "--draft-layers", "1", "--mode", "off"], None, "drop --mode off"),
    (["hi", "--draft-tokens", "0"], None, "draft-tokens"),
])
def test_bad_input_gives_one_line_error(args, stdin, message):
    result = _run(*args, stdin=stdin)
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    assert message in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("args, message", [
    (["hi", "--seed", "3"], "--seed needs --sample"),  # greedy output has nothing to seed
    (["hi", "--sample", "--seed", "3", "--compare"], "--compare checks identity with plain greedy; drop --sample"),
    (["hi", "--draft-tokens", "4"], "--draft-tokens sets a draft model's chain: add --draft-model or --draft-layers"),
])
def test_flags_that_cannot_apply_are_refused_before_the_model_loads(monkeypatch, args, message):
    import lookahead.cli.run

    def loads(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(lookahead.cli.run, "run_generate", loads)
    result = _run(*args)
    assert result.exit_code == 2 and "Traceback" not in result.output and message in result.output


def test_ctrl_c_during_a_generation_exits_130_with_one_line(monkeypatch):
    import lookahead.cli.run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lookahead.cli.run, "run_generate", interrupted)
    result = _run("hi")
    assert result.exit_code == 130 and "Traceback" not in result.output and "Aborted" not in result.output
    assert result.stderr.strip() == "lookahead: interrupted"


def test_a_draft_model_that_cannot_load_is_named_as_the_draft(tiny_folder, tmp_path):
    folder, _, _ = tiny_folder
    result = _run("hi", "--model", str(folder), "--draft-model", str(tmp_path / "nope"), "--max-new-tokens", "2")
    assert result.exit_code == 1 and result.stderr.strip().splitlines()[-1].startswith("Error: draft model: ")


@pytest.mark.parametrize("args, message", [
    (["hi", "--max-new-tokens", "1000000000"], "--max-new-tokens: 1 prompt tokens + 1000000000 new tokens exceed "
                                               "the model's context of 1024 tokens (at most 1023 new tokens fit)"),
    (["hi", "--max-new-tokens", str(10**12)], f"--max-new-tokens: 1 prompt tokens + {10**12} new tokens exceed "
                                              "the model's context of 1024 tokens (at most 1023 new tokens fit)"),
    (["hi " * 1100, "--max-new-tokens", "1"], "the prompt has 1101 tokens; the model's context is 1024 tokens"),
])
def test_prompt_and_new_tokens_must_fit_the_context(tiny_folder, args, message):
    folder, _, _ = tiny_folder
    result = _run(*args, "--model", str(folder))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1] == f"Error: {message}"  # after the weight-loading progress bar


def test_not_a_model_folder_is_one_line_error(tmp_path):
    result = _run("hi", "--model", str(tmp_path))
    assert result.exit_code != 0 and "no config.json" in result.output


def test_chat_flag_needs_a_template(tiny_folder, tmp_path):
    folder, model, tokenizer = tiny_folder
    bare = tmp_path / "bare"
    model.save_pretrained(bare)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    result = _run("hi", "--model", str(bare), "--chat")
    assert result.exit_code != 0 and "chat template" in result.output


def test_draft_model_and_draft_layers_keep_the_output(tiny_folder):
    folder, _, _ = tiny_folder
    base = ["def fibonacci(n):", "--model", str(folder), "--max-new-tokens", "24", "--stats", "--compare"]
    for extra in (["--draft-model", str(folder), "--draft-tokens", "3"], ["--draft-layers", "1"]):
        result = _run(*base, *extra)
        assert result.exit_code == 0, result.output
        assert "outputs identical: yes" in result.stderr
    assert "draft_model=" in _run(*base, "--draft-model", str(folder)).stderr  # a perfect draft is accepted


def test_bad_drafts_give_one_line_errors(tiny_folder, tmp_path):
    folder, _, tokenizer = tiny_folder
    result = _run("hi", "--model", str(folder), "--draft-layers", "5")
    assert result.exit_code != 0 and "draft layers must be in [1, 1]" in result.output
    small = tmp_path / "small-vocab"
    tiny_model("llama", dtype=torch.float32, vocab=64).save_pretrained(small)
    tokenizer.save_pretrained(small)
    result = _run("hi", "--model", str(folder), "--draft-model", str(small))
    assert result.exit_code != 0 and "vocabulary mismatch" in result.output and "Traceback" not in result.output


def test_arithmetic_flags_reach_the_config_in_both_modes():
    from lookahead.cli.options import build_config

    for mode in ("lookahead", "off"):
        config = build_config(mode, {"attention": "sdpa", "packed_linear": False, "seed": 3, "tree_budget": None,
                                     "amx_kernel": False})
        assert (config.attention, config.packed_linear, config.seed, config.amx_kernel) == ("sdpa", False, 3, False)
    assert build_config("off", {"tree_budget": 9}).tree_budget == 0  # speculation knobs do not apply to off


def test_thread_flags_set_the_threads_and_the_config(tiny_folder, monkeypatch):
    """--threads sets torch's count for the run (the same text); --fixed-threads turns the governor off."""
    from lookahead import hf

    folder, _, _ = tiny_folder
    seen = []
    own = hf.Lookahead.__call__

    @functools.wraps(own)  # transformers reads the signature for the loop's own arguments
    def spy(self, model, *args, **kwargs):
        seen.append((torch.get_num_threads(), self.config.adapt_threads))
        return own(self, model, *args, **kwargs)

    monkeypatch.setattr(hf.Lookahead, "__call__", spy)
    before = torch.get_num_threads()
    try:
        plain = _run("def f(x):", "--model", str(folder), "--max-new-tokens", "12")
        pinned = _run("def f(x):", "--model", str(folder), "--max-new-tokens", "12", "--threads", "1",
                      "--fixed-threads")
    finally:
        torch.set_num_threads(before)
    assert plain.exit_code == 0 and pinned.exit_code == 0, pinned.output
    assert pinned.stdout == plain.stdout
    assert seen == [(before, True), (1, False)]


def test_triton_attention_without_cuda_is_a_one_line_error(tiny_folder, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine can run the kernel")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    folder, _, _ = tiny_folder
    result = _run("def f(x):", "--model", str(folder), "--max-new-tokens", "4", "--attention", "triton")
    assert result.exit_code != 0
    assert "needs a CUDA device" in result.output and "Traceback" not in result.output


def test_datastore_drafts_without_changing_the_text(tiny_folder, tmp_path):
    folder, model, tokenizer = tiny_folder
    prompt = "def fibonacci(n):"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    plain = model.generate(ids, max_new_tokens=24, do_sample=False)
    (tmp_path / "code.py").write_text(tokenizer.decode(plain[0]))
    (tmp_path / "blob.bin").write_bytes(b"\x00\xff")
    result = _run(prompt, "--model", str(folder), "--max-new-tokens", "24", "--datastore", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == tokenizer.decode(plain[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert "datastore: 1 files," in result.stderr and "(1 skipped: not UTF-8 text)" in result.stderr


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_datastore_errors_are_one_line_and_come_before_loading(command, tmp_path):
    (tmp_path / "a.txt").write_text("text")
    (tmp_path / "b.bin").write_bytes(b"\x00")
    prompt = ["hi"] if command == "generate" else []
    cases = [(["--datastore", str(tmp_path / "none")], "does not exist"),
             (["--datastore", str(tmp_path), "--mode", "off"], "speculation is off"),
             (["--datastore", str(tmp_path), "--tree-budget", "0"], "speculation is off"),
             (["--datastore", str(tmp_path), "--datastore-tokens", "0"], "datastore-tokens")]
    for args, message in cases:
        result = CliRunner().invoke(main, [command, *prompt, "--model", "/no/such/model", *args])
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, args


def test_datastore_without_text_is_a_one_line_error(tiny_folder, tmp_path):
    folder, _, _ = tiny_folder
    (tmp_path / "b.bin").write_bytes(b"\x00")
    result = _run("hi", "--model", str(folder), "--datastore", str(tmp_path))
    assert result.exit_code == 1 and "no UTF-8 text files in datastore paths" in result.output
    assert "Traceback" not in result.output


def test_a_draft_head_for_another_model_or_not_a_head_is_a_one_line_error(tiny_folder, tmp_path):
    folder, _, _ = tiny_folder
    not_a_head = tmp_path / "head.safetensors"
    not_a_head.write_text("hello")
    result = _run("hi", "--model", str(folder), "--draft-head", str(not_a_head))
    assert result.exit_code != 0 and "not a readable draft head" in result.output and "Traceback" not in result.output
    other = tiny_model("llama", dtype=torch.float32, seed=9, vocab=64)
    save_head(not_a_head, head_weights(HeadNet(32, 16)), torch.arange(8), other, "test")
    result = _run("hi", "--model", str(folder), "--draft-head", str(not_a_head))
    assert result.exit_code != 0 and "was made for" in result.output and "Traceback" not in result.output
    result = _run("hi", "--model", str(folder), "--draft-head", str(tmp_path / "missing.safetensors"))
    assert result.exit_code != 0 and "does not exist" in result.output
    result = _run("hi", "--model", str(folder), "--draft-head", "auto")
    assert result.exit_code != 0 and "no draft head ships for this model" in result.output


def test_train_head_writes_a_head_that_generate_uses(tiny_folder, tmp_path):
    folder, model, tokenizer = tiny_folder
    out, data = tmp_path / "tiny-head.safetensors", tmp_path / "texts.pt"
    args = ["train-head", str(out), "--model", str(folder), "--sequences", "4", "--epochs", "2", "--batch", "2",
            "--data", str(data)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "distilled" in result.stderr and "held-out top-1" in result.output and out.is_file() and data.is_file()
    again = CliRunner().invoke(main, args + ["--init", str(out), "--lr", "3e-4"])  # texts read back, head trained on
    assert again.exit_code == 0 and "read 4 distilled texts" in again.stderr
    assert "2 epochs from tiny-head.safetensors" in read_metadata(out)["trained"]
    prompt = "def fibonacci(n):"
    result = _run(prompt, "--model", str(folder), "--max-new-tokens", "16", "--draft-head", str(out))
    assert result.exit_code == 0, result.output
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    plain = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert result.stdout.strip() == tokenizer.decode(plain[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_build_prior_writes_a_prior_that_generate_uses(tiny_folder, tmp_path):
    folder, model, tokenizer = tiny_folder
    out, data = tmp_path / "tiny-prior.safetensors", tmp_path / "texts.pt"
    args = ["build-prior", str(out), "--model", str(folder), "--sequences", "4", "--batch", "2", "--data", str(data),
            "--min-count", "1"]
    result = CliRunner().invoke(main, args + ["--distill-dtype", "bfloat16"])  # texts written by a bfloat16 copy
    assert result.exit_code == 0, result.output
    assert "distilled" in result.stderr and "rows" in result.output and out.is_file() and data.is_file()
    again = CliRunner().invoke(main, args + ["--k", "2"])  # the texts are read back
    assert again.exit_code == 0 and "read 4 distilled texts" in again.stderr and "top 2" in again.output
    prompt = "def fibonacci(n):"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    plain = model.generate(ids, max_new_tokens=16, do_sample=False)
    for spec, pairs in ((str(out), "--recycle-pairs"), (str(out), "--no-recycle-pairs"), ("none", "--recycle-pairs"),
                        ("auto", "--recycle-pairs")):  # "auto" finds no prior for a random model: drafts without one
        result = _run(prompt, "--model", str(folder), "--max-new-tokens", "16", "--recycle-prior", spec, pairs)
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == tokenizer.decode(plain[0, ids.shape[1]:], skip_special_tokens=True).strip()
    other = tiny_model("llama", dtype=torch.float32, seed=9, vocab=64)
    save_head(tmp_path / "head.safetensors", head_weights(HeadNet(32, 16)), torch.arange(8), other, "test")
    for bad, message in ((tmp_path / "head.safetensors", "not a lookahead recycling prior file"),
                         (tmp_path / "missing.safetensors", "does not exist")):
        result = _run(prompt, "--model", str(folder), "--recycle-prior", str(bad))
        assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output
    empty = CliRunner().invoke(main, ["build-prior", str(tmp_path / "p.safetensors"), "--model", str(folder),
                                      "--data", str(data), "--min-count", "100000"])
    assert empty.exit_code == 0 and "0 token rows, 0 pair rows" in empty.output


def test_train_head_refuses_a_missing_output_folder(tmp_path):
    result = CliRunner().invoke(main, ["train-head", str(tmp_path / "no" / "head.safetensors")])
    assert result.exit_code != 0 and "does not exist" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["train-head", str(tmp_path / "head.safetensors"), "--distill-dtype", "half"])
    assert result.exit_code == 2 and "'half' is not one of 'bfloat16', 'float32'" in result.output


def test_train_head_refuses_an_init_head_of_another_model(tiny_folder, tmp_path):
    folder, _, _ = tiny_folder
    other, init = tiny_model("llama", dtype=torch.float32, seed=9, vocab=64), tmp_path / "other.safetensors"
    save_head(init, head_weights(HeadNet(32, 16)), torch.arange(8), other, "test")
    result = CliRunner().invoke(main, ["train-head", str(tmp_path / "h.safetensors"), "--model", str(folder),
                                       "--init", str(init)])
    assert result.exit_code != 0 and "--init" in result.output and "was made for" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--head-candidates", "5"], "add --draft-head"),
    (["--window-columns", "8"], "add --window-levels"),
])
def test_knobs_that_would_do_nothing_are_refused(args, message):
    result = _run("hi", *args)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
