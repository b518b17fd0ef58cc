"""Tests of benchmarks/bench_lade.py that run in the main environment (no lade, transformers 5): the module
imports without lade, options and lade configs parse or fail with one line, the HF folder rewrite for
transformers 4.34, the chat-template proxy, step counting, and the summary/table maths on synthetic runs; the
suite loop itself on a tiny model with a stand-in `lade` module."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import jinja2
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_lade  # noqa: E402  (the benchmarks folder is not a package)
import harness  # noqa: E402
from harness import mark_identity, summarize  # noqa: E402
from bench_lade import LadeConfig, parse_lade_config  # noqa: E402
from prompts import Prompt  # noqa: E402
from tiny_models import word_tokenizer  # noqa: E402


def test_importable_without_lade():
    assert "lade" not in sys.modules


# ---- lade configs and options ----

@pytest.mark.parametrize("text, expected", [
    ("5,7,7", (5, 7, 7)),
    (" 3 , 4 , 2 ", (3, 4, 2)),
    ("level=5,window=7,guess=7", (5, 7, 7)),
    ("guess=2, level=4, window=3", (4, 3, 2)),
])
def test_parse_lade_config(text, expected):
    config = parse_lade_config(text)
    assert (config.level, config.window, config.guess) == expected
    assert config.method == "lade_n{}_w{}_g{}".format(*expected)


@pytest.mark.parametrize("text, message", [
    ("5,7", "LEVEL,WINDOW,GUESS"),
    ("5,7,7,1", "LEVEL,WINDOW,GUESS"),
    ("level=5,window=7,size=7", "each of level, window, guess once"),
    ("level=5,level=7,guess=7", "each of level, window, guess once"),
    ("5,x,7", "bad lade config '5,x,7'"),
    ("2,7,7", "level >= 3"),
    ("5,0,7", "window >= 1"),
    ("5,7,0", "guess >= 1"),
])
def test_parse_lade_config_errors(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_lade_config(text)


def test_method_table_rejects_duplicates():
    configs = [LadeConfig(5, 7, 7), LadeConfig(3, 3, 3)]
    assert bench_lade.method_table(configs) == {"hf_greedy": None, "lade_n5_w7_g7": configs[0],
                                                "lade_n3_w3_g3": configs[1]}
    with pytest.raises(ValueError, match="distinct"):
        bench_lade.method_table([LadeConfig(5, 7, 7), LadeConfig(5, 7, 7)])


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_defaults(model_dir):
    args = bench_lade.parse_args(["--model", str(model_dir)])
    assert (args.prompts_per_category, args.max_new_tokens, args.repeats, args.threads) == (3, 96, 2, 2)
    assert args.lade_configs == [LadeConfig(5, 7, 7)]
    assert args.out == bench_lade.RESULTS_DIR / "lade-cpu.json"
    assert [p.category for p in args.prompts] == [c for c in args.categories for _ in range(3)]


def test_sizes_and_configs(model_dir):
    args = bench_lade.parse_args(["--model", str(model_dir), "--window", "3", "--categories", "code",
                                  "--prompts-per-category", "1"])
    assert args.lade_configs == [LadeConfig(5, 3, 7)]
    args = bench_lade.parse_args(["--model", str(model_dir), "--lade-config", "7,5,7", "--lade-config",
                                  "level=3,window=3,guess=3", "--categories", "code", "--prompts-per-category", "1"])
    assert args.lade_configs == [LadeConfig(7, 5, 7), LadeConfig(3, 3, 3)]


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be at least 1"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--level", "4", "--lade-config", "5,7,7"], "either --level/--window/--guess or --lade-config"),
    (["--lade-config", "5,7"], "LEVEL,WINDOW,GUESS"),
    (["--lade-config", "5,7,7", "--lade-config", "level=5,window=7,guess=7"], "distinct"),
    (["--level", "2"], "level >= 3"),
    (["--categories", "poetry"], "invalid choice: 'poetry'"),
    (["--prompts-per-category", "many"], "invalid int value"),
    (["--reference", "/no/such/file.json"], "--reference file not found"),
    (["--prompts-per-category", "999"], "has only"),
])
def test_bad_arguments_give_one_line_errors(model_dir, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench_lade.parse_args(["--model", str(model_dir), *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: " in error and message in error


def test_missing_model_folder(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_lade.parse_args(["--model", str(tmp_path / "nothing")])
    assert "is not an HF folder (run benchmarks/lade_setup.sh first)" in capsys.readouterr().err


# ---- the HF folder for transformers 4.34 ----

V5_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16", "head_dim": 64,
             "hidden_size": 576, "num_attention_heads": 9, "attention_bias": False, "mlp_bias": False,
             "quantization_config": None, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}


def test_fix_config():
    config = json.loads(json.dumps(V5_CONFIG))
    changes = bench_lade.fix_config(config)
    assert config["rope_theta"] == 100000.0 and config["torch_dtype"] == "float32"
    assert not {"rope_parameters", "dtype", "quantization_config"} & set(config)
    assert len(changes) == 3
    assert bench_lade.fix_config(config) == ["torch_dtype=float32"]  # a second pass has nothing else to do


@pytest.mark.parametrize("change, message", [
    ({"quantization_config": {"quant_method": "gguf"}}, "quantized"),
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3"}}, "rope_type 'llama3'"),
    ({"mlp_bias": True}, "biases"),
    ({"head_dim": 128}, "head_dim 128"),
])
def test_fix_config_refuses_what_434_cannot_express(change, message):
    with pytest.raises(ValueError, match=message):
        bench_lade.fix_config({**V5_CONFIG, **change})


def test_fix_tokenizer_config():
    config = {"tokenizer_class": "TokenizersBackend", "backend": "tokenizers", "is_local": True,
              "local_files_only": False, "eos_token": "<|im_end|>"}
    changes = bench_lade.fix_tokenizer_config(config, "{{ messages }}")
    assert config == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                      "chat_template": "{{ messages }}"}
    assert len(changes) == 5
    assert bench_lade.fix_tokenizer_config(config, "{{ messages }}") == []


def test_fix_tokenizer_json():
    tokenizer = {"model": {"type": "BPE", "ignore_merges": False, "merges": [["Ġ", "t"], ["i", "n"]]}}
    assert bench_lade.fix_tokenizer_json(tokenizer) == ["BPE merges as 'a b' strings"]
    assert tokenizer == {"model": {"type": "BPE", "merges": ["Ġ t", "i n"]}}
    assert bench_lade.fix_tokenizer_json(tokenizer) == []
    with pytest.raises(ValueError, match="ignore_merges"):
        bench_lade.fix_tokenizer_json({"model": {"type": "BPE", "ignore_merges": True, "merges": []}})
    with pytest.raises(ValueError, match="space"):
        bench_lade.fix_tokenizer_json({"model": {"type": "BPE", "merges": [["a b", "c"]]}})


def test_make_folder_compatible(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V5_CONFIG))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "merges": [["a", "b"]]}}))
    (tmp_path / "chat_template.jinja").write_text("{{ x }}")
    changes = bench_lade.make_folder_compatible(tmp_path)
    assert "config.json: rope_parameters -> rope_theta=100000.0" in changes
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"] == "{{ x }}"
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["merges"] == ["a b"]
    assert (tmp_path / bench_lade.MARKER).is_file()


# ---- the chat-template proxy, switching and counting ----

class FakeTokenizer434:
    """What Tokenizer434 uses of a transformers 4.34 tokenizer."""

    chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    special_tokens_map = {"eos_token": "</s>"}
    vocab_size = 7

    def _compile_jinja_template(self, template):
        return jinja2.Template(template)

    def __call__(self, text, **kwargs):
        return ("called", text, kwargs)


def test_tokenizer434_passes_add_generation_prompt():
    tokenizer = bench_lade.Tokenizer434(FakeTokenizer434())
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "<hi>A:"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "<hi>"
    assert tokenizer.vocab_size == 7 and tokenizer("x", add_special_tokens=False) == (
        "called", "x", {"add_special_tokens": False})
    with pytest.raises(ValueError, match="text only"):
        tokenizer.apply_chat_template(messages, tokenize=True)


@pytest.fixture
def fake_lade(monkeypatch):
    """A stand-in `lade` module recording `config_lade` calls."""
    module, decoding = types.ModuleType("lade"), types.ModuleType("lade.decoding")
    module.calls, module.augmented, decoding.FUNC_MAP = [], 0, {}
    module.config_lade = lambda **kwargs: module.calls.append(kwargs)

    def augment_all():  # like lade's: keeps the original greedy_search and installs its proxy
        module.augmented += 1
        decoding.FUNC_MAP["greedy_search"] = "original"

    module.augment_all, module.decoding = augment_all, decoding
    monkeypatch.setitem(sys.modules, "lade", module)
    monkeypatch.setitem(sys.modules, "lade.decoding", decoding)
    monkeypatch.setenv("USE_LADE", "unset")
    monkeypatch.setenv("CHAT", "1")
    return module


def test_enable_lade_patches_once(fake_lade):
    bench_lade.enable_lade()
    bench_lade.enable_lade()
    assert fake_lade.augmented == 1 and os.environ["CHAT"] == "0"


def test_switch_lade(fake_lade):
    bench_lade.switch_lade(LadeConfig(4, 6, 2))
    assert os.environ["USE_LADE"] == "1"
    assert fake_lade.calls == [{"LEVEL": 4, "WINDOW_SIZE": 6, "GUESS_SET_SIZE": 2, "DEBUG": 0}]
    bench_lade.switch_lade(None)
    assert os.environ["USE_LADE"] == "0" and len(fake_lade.calls) == 1


class TwoForwards(torch.nn.Module):
    """A module with `forward` and a lade-style `jforward_multilevel` that does not call `forward`."""

    def forward(self, x):
        return x + 1

    def jforward_multilevel(self, x):
        return x * 2


def test_step_counter_counts_both_forwards_and_restores():
    model = TwoForwards()
    with bench_lade.StepCounter(model) as counter:
        model(torch.zeros(1))
        assert model.jforward_multilevel(torch.ones(1)).item() == 2.0
        model.jforward_multilevel(torch.ones(1))
        assert counter.count == 3
    assert "jforward_multilevel" not in vars(model) and not model._forward_pre_hooks
    model(torch.zeros(1))
    assert counter.count == 3


def test_progress_counter(capsys):
    counter = harness.PlainProgress(3, enabled=True)
    counter.update()
    counter.update()
    counter.close()
    assert capsys.readouterr().err == "\r1/3 runs\r2/3 runs\n"
    silent = harness.PlainProgress(3, enabled=False)
    silent.update()
    assert capsys.readouterr().err == ""


# ---- summary and tables on synthetic runs ----

def run(prompt_id, category, repeat, method, seconds, tokens, forwards):
    """One synthetic run record with the fields `timed_run` and `run_suite` produce."""
    return {"prompt_id": prompt_id, "category": category, "repeat": repeat, "slot": 0, "method": method,
            "seconds": seconds, "prompt_tokens": 10, "new_tokens": len(tokens),
            "tokens_per_second": len(tokens) / seconds, "forwards": forwards,
            "tokens_per_step": (len(tokens) - 1) / (forwards - 1), "tokens": tokens}


LADE = "lade_n5_w7_g7"


def synthetic_result() -> dict:
    """Two prompts (code, chat) x two repetitions; lade is 2x slower on code and identical, 1.25x faster on
    chat, where it diverges in repetition 1."""
    runs = []
    for repeat in range(2):
        jitter = 0.5 * repeat  # repetition 1 is slower for both methods
        rounds = [[run("c/0", "code", repeat, "hf_greedy", 2.0 + jitter, [1, 2, 3, 4, 5], 5),
                   run("c/0", "code", repeat, LADE, 4.0 + jitter, [1, 2, 3, 4, 5], 5)],
                  [run("t/0", "chat", repeat, "hf_greedy", 5.0 + jitter, [7, 8, 9, 7, 8], 5),
                   run("t/0", "chat", repeat, LADE, 4.0 + jitter, [7, 8, 9, 7, 8] if repeat == 0 else
                       [7, 8, 0, 7, 8], 3)]]
        for round_runs in rounds:
            mark_identity(round_runs)
            runs += round_runs
    return {"command": "python bench_lade.py", "model": "folder", "settings": {
                "methods": ["hf_greedy", LADE], "repeats": 2, "max_new_tokens": 5, "dtype": "float32"},
            "machine": {"cpu": "cpu", "cpu_count": 2, "threads": 1, "torch": "2.13.0", "transformers": "4.34.0",
                        "lade": "0.0.2", "load_average": [1.0, 1.5]},
            "runs": runs, "summary": summarize(runs, ["hf_greedy", LADE])}


def test_summary_maths():
    summary = synthetic_result()["summary"]
    code, chat, every = summary["code"][LADE], summary["chat"][LADE], summary["all"][LADE]
    assert code["time_median_s"] == pytest.approx(4.25) and code["time_min_s"] == pytest.approx(4.0)
    assert code["speedup_vs_hf_greedy"] == pytest.approx(2.25 / 4.25)
    assert chat["speedup_vs_hf_greedy"] == pytest.approx(5.25 / 4.25)
    assert every["speedup_vs_hf_greedy"] == pytest.approx((2.25 + 5.25) / (4.25 + 4.25))
    assert chat["tokens_per_step"] == pytest.approx(2.0) and code["tokens_per_step"] == pytest.approx(1.0)
    assert (chat["identical_runs"], chat["checked_runs"]) == (1, 2) and code["identical_rate"] == 1.0
    assert summary["code"]["hf_greedy"]["tokens_per_second"] == pytest.approx(5 / 2.25)


def test_format_tables():
    result = synthetic_result()
    result.update(reference="main.json", reference_check={"compared": 2, "identical": 1, "diverged": {"t/0": 3}},
                  reference_speedups={"code": 1.24, "all": 1.2})
    text = bench_lade.format_tables(result)
    assert "lade 0.0.2" in text and "load average 1.0 → 1.5" in text and "`python bench_lade.py`" in text
    assert "1/2 prompts token-identical, first divergence at {'t/0': 3}" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| category | prompts | HF greedy 4.34 tok/s | lade_n5_w7_g7 tok/s")
    assert rows[1] == "| code | 1 | 2.2 | 1.2 | 0.53x / 0.50x | 1.00 | 2/2 | 1.24x |"
    assert rows[2] == "| chat | 1 | 1.0 | 1.2 | 1.24x / 1.25x | 2.00 | 1/2 | – |"
    assert rows[3].startswith("| **all** | 2 |") and rows[3].endswith("| 3/4 | 1.20x |")


def test_reference_check_and_speedups():
    result = synthetic_result()
    reference = {"runs": [{"prompt_id": "c/0", "method": "hf_greedy", "tokens": [1, 2, 3, 4, 5, 6, 7]},
                          {"prompt_id": "t/0", "method": "hf_greedy", "tokens": [7, 8, 1]},
                          {"prompt_id": "t/0", "method": "lookahead", "tokens": [7, 8, 9]},
                          {"prompt_id": "x/9", "method": "hf_greedy", "tokens": [1]}],
                 "summary": {"code": {"lookahead": {"speedup_vs_hf_greedy": 1.5}}, "chat": {"hf_greedy": {}}}}
    assert bench_lade.reference_check(result, reference) == {"compared": 2, "identical": 1, "diverged": {"t/0": 2}}
    assert bench_lade.reference_speedups(reference) == {"code": 1.5}


# ---- the suite loop, with a stand-in lade (plain greedy) on a tiny model ----

def test_run_suite_interleaves_and_marks_identity(tiny_model, fake_lade, monkeypatch):
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    monkeypatch.setattr(type(model), "jforward_multilevel", lambda self, *a, **k: None, raising=False)
    prompts = [Prompt(id="t/0", category="code", text="w5 w9 w12 w7 w5 w9", chat=False),
               Prompt(id="t/1", category="chat", text="w20 w21 w22 w20", chat=True)]
    configs = [LadeConfig(5, 7, 7), LadeConfig(3, 3, 3)]
    result = bench_lade.run_suite(model, word_tokenizer(), prompts, configs, repeats=2, max_new_tokens=4,
                                  progress=False)
    runs = result["runs"]
    assert len(runs) == 2 * 2 * 3 and len(fake_lade.calls) == 2 + 2 * 2 * 2  # warm-up + every lade run
    assert all(r["new_tokens"] == 4 and r["forwards"] == 4 for r in runs)  # the stand-in lade is plain greedy
    assert all(r["identical"] for r in runs if r["method"] != "hf_greedy")
    assert len({r["method"] for r in runs if r["slot"] == 0}) == 3  # the order rotates
    assert result["settings"]["methods"] == ["hf_greedy", "lade_n5_w7_g7", "lade_n3_w3_g3"]
    assert [p["prompt_tokens"] for p in result["prompts"]] == [6, 7]
    assert set(result["summary"]) == {"code", "chat", "all"}
