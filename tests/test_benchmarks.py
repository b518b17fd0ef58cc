"""Smoke tests of the benchmark suite (benchmarks/): the core loop on a tiny random model, prompts, options."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_generate  # noqa: E402  (the benchmarks folder is not a package)
import harness  # noqa: E402
from prompts import Prompt, encode, load_prompts, prompt_index  # noqa: E402
from tiny_models import word_tokenizer  # noqa: E402

from lookahead import LookaheadConfig  # noqa: E402

METHODS = ["hf_greedy", "hf_prompt_lookup", "lookahead"]
REPEATS = 2


PROMPTS = [
    Prompt(id="t/0", category="code", text="w5 w9 w12 w7 w30 w5 w9 w12 w7 w41 w5 w9", chat=False),
    Prompt(id="t/1", category="chat", text="w20 w21 w22 w23 w20 w21 w22 w24 w20 w21", chat=True),
]


@pytest.fixture(scope="module")
def result(tiny_model):
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    config = LookaheadConfig(window_levels=2, window_columns=3, tree_budget=8)
    out = bench_generate.run_suite(model, word_tokenizer(), PROMPTS, METHODS, REPEATS, 8, config,
                                   prompt_lookup_tokens=4, progress=False)
    out.update(machine=harness.machine_info(threads=1), model="tiny llama", command="python bench")
    return out


def test_runs_are_interleaved_and_complete(result):
    runs = result["runs"]
    assert len(runs) == len(PROMPTS) * len(METHODS) * REPEATS
    for run in runs:
        assert run["new_tokens"] == 8 and len(run["tokens"]) == 8
        assert run["seconds"] > 0 and run["tokens_per_second"] > 0
        assert 0 < run["first_token_seconds"] < run["seconds"]  # prompt lookup's loop clocks it too
    first_slots = [run["method"] for run in runs if run["slot"] == 0]
    assert len(set(first_slots)) > 1  # the order rotates from prompt to prompt


def test_identity_is_checked_against_greedy(result):
    for run in result["runs"]:
        if run["method"] == "hf_greedy":
            assert run["identical"] is None and run["tokens_per_step"] == 1.0
        else:
            assert run["identical"] is True and run["first_divergence"] is None  # fp64: exact


def test_lookahead_stats_match_counted_forwards(result):
    for run in result["runs"]:
        if run["method"] == "lookahead":
            assert run["forwards"] == run["stats"]["steps"] + 1  # prefill + decoding steps
            assert run["tokens_per_step"] == pytest.approx(run["stats"]["mean_tokens_per_step"])
        else:
            assert run["stats"] is None


def test_summary_structure(result):
    summary = result["summary"]
    assert list(summary) == ["code", "chat", "all"]
    for group, per_method in summary.items():
        assert set(per_method) == set(METHODS)
        look = per_method["lookahead"]
        assert look["prompts"] == (2 if group == "all" else 1) and look["runs"] == look["prompts"] * REPEATS
        assert look["identical_rate"] == 1.0 and look["checked_runs"] == look["runs"]
        assert per_method["hf_greedy"]["identical_rate"] is None
        for baseline in ("hf_greedy", "hf_prompt_lookup"):
            assert look[f"speedup_vs_{baseline}"] > 0 and look[f"speedup_vs_{baseline}_min"] > 0
        assert per_method["hf_greedy"]["speedup_vs_hf_greedy"] == pytest.approx(1.0)
    assert json.loads(json.dumps(result))["settings"]["methods"] == METHODS


def test_per_prompt_line_names_the_extremes_and_the_prompts_below_one():
    runs = [{"prompt_id": pid, "method": method, "seconds": seconds, "new_tokens": 10}
            for pid, method, seconds in (("a", "hf_greedy", 2.0), ("a", "hf_greedy", 4.0), ("a", "lookahead", 1.0),
                                         ("a", "lookahead", 3.0), ("b", "hf_greedy", 1.0), ("b", "lookahead", 1.25),
                                         ("b", "lookahead", 0.9), ("c", "lookahead", 1.0))]
    ratios = bench_generate.per_prompt_ratios(runs, "lookahead", "hf_greedy")
    assert set(ratios) == {"a", "b"}  # c: no baseline run
    assert ratios["a"] == pytest.approx((1.5, 2.0)) and ratios["b"] == pytest.approx((1.0 / 1.075, 1.0 / 0.9))
    shorter = [dict(run, new_tokens=5) if run["method"] == "lookahead" else run for run in runs]
    assert bench_generate.per_prompt_ratios(shorter, "lookahead", "hf_greedy")["a"] == pytest.approx((0.75, 1.0))
    line = bench_generate.per_prompt_line(runs, "lookahead", "hf_greedy")
    assert line == ("Per prompt, lookahead vs hf_greedy: 0.93x (b) to 1.50x (a); 1 of 2 below 1.0x by median time "
                    "(b), 0 by best time.")
    assert bench_generate.per_prompt_line(runs, "lookahead", "hf_prompt_lookup") is None


def test_table_has_a_row_per_category_and_all(result):
    table = bench_generate.format_tables(result)
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows] == ["| category", "| code", "| chat", "| **all**"]
    assert "Command: `python bench`" in table
    assert "Per prompt, lookahead vs hf_greedy: " in table and "Per prompt, lookahead vs hf_prompt_lookup: " in table


def test_plots_are_written(result, tmp_path):
    pytest.importorskip("matplotlib")
    from plots import save_plots

    paths = save_plots(result, tmp_path / "run.json")
    assert [p.name for p in paths] == ["run-speedup.png", "run-tokens-per-step.png", "run-calibration.png"]
    assert all(p.stat().st_size > 0 for p in paths)


def test_encode_applies_the_chat_template_only_to_chat_prompts():
    tokenizer = word_tokenizer()
    assert encode(tokenizer, PROMPTS[0]).tolist() == [[5, 9, 12, 7, 30, 5, 9, 12, 7, 41, 5, 9]]
    chat = encode(tokenizer, PROMPTS[1])[0].tolist()
    assert chat[0] == 1 and chat[-2:] == [2, 3]


def test_load_prompts_round_robin_and_errors(tmp_path):
    items = [{"id": f"s/{i}", "category": c, "turns": [f"text {i}", "second turn"]}
             for i, c in enumerate(["writing", "writing", "roleplay", "rag", "math"])]
    (tmp_path / "spec_bench.jsonl").write_text("\n".join(json.dumps(item) for item in items) + "\n")
    chat = load_prompts(["chat"], 3, tmp_path)
    assert [p.id for p in chat] == ["s/0", "s/2", "s/4"]  # writing, roleplay, math, then the 2nd writing
    assert all(p.chat and p.category == "chat" and not p.text.startswith("second") for p in chat)
    with pytest.raises(ValueError, match="only 1 prompts"):
        load_prompts(["rag"], 2, tmp_path)
    with pytest.raises(ValueError, match="unknown categories"):
        load_prompts(["poetry"], 1, tmp_path)
    with pytest.raises(ValueError, match="prompt file not found"):
        load_prompts(["code"], 1, tmp_path)
    held_out = load_prompts(["chat"], 2, tmp_path, skip=2)
    assert [p.id for p in held_out] == ["s/4", "s/1"]  # after writing and roleplay: math, the 2nd writing
    with pytest.raises(ValueError, match="only 4 prompts, 3 skipped and 2 requested"):
        load_prompts(["chat"], 2, tmp_path, skip=3)
    with pytest.raises(ValueError, match="at least 0"):
        load_prompts(["chat"], 1, tmp_path, skip=-1)
    index = prompt_index(["chat", "rag"], tmp_path)
    assert sorted(index) == ["s/0", "s/1", "s/2", "s/3", "s/4"] and index["s/3"].category == "rag"


def test_long_code_prompts_are_files_of_finished_functions_then_one_to_complete(tmp_path, monkeypatch):
    import prompts

    monkeypatch.setattr(prompts, "CATEGORIES", {**prompts.CATEGORIES, "long_code": prompts.CategorySpec(
        "humaneval.jsonl", ("code",), chat=False, context=2)})
    items = [{"id": f"H/{i}", "category": "code", "turns": [f"def f{i}():\n"], "reference": f"    return {i}\n"}
             for i in range(7)]
    (tmp_path / "humaneval.jsonl").write_text("\n".join(json.dumps(item) for item in items) + "\n")
    long = load_prompts(["long_code"], 2, tmp_path)
    assert [p.id for p in long] == ["H/2+H/0", "H/5+H/3"] and not any(p.chat for p in long)
    assert long[0].text == "def f0():\n    return 0\n\n\ndef f1():\n    return 1\n\n\ndef f2():\n"
    with pytest.raises(ValueError, match="only 2 prompts"):  # 7 items make two files of three; the last is short
        load_prompts(["long_code"], 3, tmp_path)
    monkeypatch.undo()
    real = load_prompts(["long_code"], 1)[0]  # the vendored HumanEval: 8 finished functions, then the 9th
    assert real.id == "HumanEval/8+HumanEval/0" and real.text.count("def ") >= 9


@pytest.mark.parametrize(("pairs", "expected"), [
    (["window_levels=3"], {"window_levels": 3}),
    (["pool_from_text=false", "tree_budget = 32"], {"pool_from_text": False, "tree_budget": 32}),
    (["draft_head=my-head.safetensors", "seed=3"], {"draft_head": "my-head.safetensors", "seed": 3}),  # None defaults
])
def test_parse_overrides(pairs, expected):
    assert harness.parse_overrides(pairs) == expected


@pytest.mark.parametrize(("pairs", "message"), [
    (["window_levels"], "key=value"),
    (["no_such_knob=1"], "unknown lookahead option"),
    (["tree_budget=big"], "tree_budget must be int"),
    (["pool_from_text=maybe"], "pool_from_text must be true or false"),
])
def test_parse_overrides_errors(pairs, message):
    with pytest.raises(ValueError, match=message):
        harness.parse_overrides(pairs)


def test_suite_rejects_assisted_without_a_draft_model():
    with pytest.raises(ValueError, match="draft model"):
        bench_generate.run_suite(None, None, PROMPTS, ["hf_greedy", "hf_assisted"], 1, 8, LookaheadConfig())


def test_suite_runs_the_draft_methods_identically(tiny_model):
    from lookahead.draft_model import early_exit_draft

    model = tiny_model("llama", dtype=torch.float64, seed=0, layers=3)
    methods = ["hf_greedy", "hf_assisted", "lookahead_draft"]
    out = bench_generate.run_suite(model, word_tokenizer(), PROMPTS, methods, 1, 8, LookaheadConfig(),
                                   draft_model=early_exit_draft(model, 2), progress=False)
    assert {run["method"] for run in out["runs"]} == set(methods)
    assert all(run["identical"] for run in out["runs"] if run["method"] != "hf_greedy")
    assert all(run["stats"] is not None for run in out["runs"] if run["method"] == "lookahead_draft")


def test_parse_args_draft_options(capsys):
    args = bench_generate.parse_args(["--categories", "code", "--prompts-per-category", "1", "--draft-layers", "4"])
    assert args.methods == ["hf_greedy", "hf_prompt_lookup", "lookahead", "lookahead_off", "hf_assisted",
                            "lookahead_draft"]
    for argv, message in [(["--draft-layers", "2", "--draft-model", "x"], "not allowed with"),
                          (["--methods", "lookahead_draft"], "needs --draft-model PATH or --draft-layers N"),
                          (["--draft-layers", "0"], "--draft-layers must be at least 1")]:
        with pytest.raises(SystemExit):
            bench_generate.parse_args(["--categories", "code", "--prompts-per-category", "1", *argv])
        assert message in capsys.readouterr().err


def test_batch_benchmark_runs_and_checks_identity(tiny_model):
    import bench_batch

    model = tiny_model("llama", dtype=torch.float64, seed=0)
    model.generation_config.eos_token_id = 7
    tokenizer = word_tokenizer()
    prompts = PROMPTS * 2
    out = bench_batch.run_batches(model, tokenizer, prompts, [1, 2, 4], 1, 6, LookaheadConfig(), progress=False)
    assert {r["batch_size"] for r in out["runs"]} == {1, 2, 4} and len(out["runs"]) == 2 * (4 + 2 + 1)
    assert all(r["identical"] for r in out["runs"])
    assert set(out["summary"]) == {"1", "2", "4"} and out["summary"]["4"]["lookahead"]["identical"] == 1
    table = bench_batch.format_table({"command": "python x", **out})
    assert table.count("\n| ") == 4


def test_batch_benchmark_times_its_runs_inside_during_after_the_warm_up(tiny_model, monkeypatch):
    """`--busy`: the busy processes run through the timed repetitions only (the warm-up measures the cost curves)."""
    import contextlib

    import bench_batch

    model, events = tiny_model("llama", dtype=torch.float64, seed=0), []
    generate = bench_batch._generate
    monkeypatch.setattr(bench_batch, "_generate", lambda *a, **k: events.append("run") or generate(*a, **k))

    @contextlib.contextmanager
    def during():
        events.append("busy")
        yield
        events.append("idle")

    out = bench_batch.run_batches(model, word_tokenizer(), PROMPTS * 2, [2], 1, 6, LookaheadConfig(), progress=False,
                                  during=during)
    assert events == ["run", "run", "busy", "run", "run", "idle"]  # warm-up of both methods, then 1 group x 2
    assert out["summary"]["2"]["lookahead"]["fewer_threads_steps"] == 0  # conftest's governor: an idle machine
    table = bench_batch.format_table({"command": "python x", "busy_processes": 1, **out})
    assert "beside 1 busy processes" in table and "steps on fewer threads" in table


def test_batch_benchmark_samples_with_sample(tiny_model):
    import bench_batch

    model = tiny_model("llama", dtype=torch.float64, seed=0)
    prompts = PROMPTS * 2
    out = bench_batch.run_batches(model, word_tokenizer(), prompts, [1, 4], 1, 6, LookaheadConfig(), progress=False,
                                  sample=True)
    assert {r["method"] for r in out["runs"]} == {"hf_sample", "lookahead_sample"}
    assert all(r["identical"] is None for r in out["runs"]) and out["settings"]["sampling"]["do_sample"]
    assert out["summary"]["4"]["speedup"] > 0
    table = bench_batch.format_table({"command": "python x", **out})
    assert "HF sampling tok/s" in table and "identical" not in table and table.count("\n| ") == 3


def test_batch_benchmark_counts_tokens_up_to_eos():
    import bench_batch

    output = torch.tensor([[1, 1, 5, 7, 0, 0], [1, 1, 5, 5, 5, 5]])
    assert bench_batch.generated_tokens(output, 2, {7}) == 2 + 4
    ids, mask = bench_batch.left_pad([torch.tensor([3, 4]), torch.tensor([5])], pad=0)
    assert ids.tolist() == [[3, 4], [0, 5]] and mask.tolist() == [[1, 1], [0, 1]]


def test_batch_benchmark_argument_errors(capsys):
    import bench_batch

    for argv, message in [(["--batch-sizes", "0"], "at least 1"),
                          (["--categories", "code", "--prompts-per-category", "1"], "largest batch needs 8")]:
        with pytest.raises(SystemExit):
            bench_batch.parse_args(argv)
        assert message in capsys.readouterr().err


def test_each_lookahead_method_runs_its_own_config():
    kwargs = bench_generate.method_kwargs(["lookahead", "lookahead_no_prior", "lookahead_pairs", "lookahead_head",
                                           "lookahead_off"],
                                          LookaheadConfig(tree_budget=8), 10, None)
    configs = {method: extra["custom_generate"].config for method, extra in kwargs.items()}
    assert configs["lookahead"].recycle_prior == "auto" and configs["lookahead_no_prior"].recycle_prior is None
    assert not configs["lookahead"].recycle_pairs and configs["lookahead_pairs"].recycle_pairs
    assert configs["lookahead_no_prior"].tree_budget == 8 and configs["lookahead_head"].draft_head == "auto"
    assert configs["lookahead_off"].tree_budget == 0


def test_a_benchmark_process_starts_no_kernel_compile_helper(monkeypatch, tmp_path):
    """A helper compiling beside a benchmark would slow whatever the benchmark times first (a baseline)."""
    import importlib

    import numba

    from lookahead import kernel_warmup, numba_cache

    monkeypatch.setenv(kernel_warmup.ENV_SWITCH, "1")
    monkeypatch.setattr(numba_cache, "_own_folder", True)
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))  # an empty folder: the helper would be wanted
    importlib.reload(harness)
    assert kernel_warmup.start(((sys.executable, "-c", "pass"),)) is False
