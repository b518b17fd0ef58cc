"""The speed suite's ablation, sampled and mode-off comparisons (benchmarks/bench_generate.py) on a tiny model."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_generate  # noqa: E402  (the benchmarks folder is not a package)
import harness  # noqa: E402
from prompts import Prompt  # noqa: E402
from tiny_models import word_tokenizer  # noqa: E402

from lookahead import LookaheadConfig  # noqa: E402
from lookahead.recycle import RecycleTable  # noqa: E402

PROMPTS = [
    Prompt(id="t/0", category="code", text="w5 w9 w12 w7 w30 w5 w9 w12 w7 w41 w5 w9", chat=False),
    Prompt(id="t/1", category="chat", text="w20 w21 w22 w23 w20 w21 w22 w24 w20 w21", chat=True),
]
METHODS = ["hf_greedy", "lookahead", "lookahead_off", "lookahead_prompt", "lookahead_recycle", "hf_sample",
           "lookahead_sample"]


@pytest.fixture(scope="module")
def result(tiny_model):
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    out = bench_generate.run_suite(model, word_tokenizer(), PROMPTS, METHODS, 1, 8, LookaheadConfig(tree_budget=8),
                                   progress=False)
    out.update(machine=harness.machine_info(threads=1), model="tiny llama", command="python bench")
    return out


def test_greedy_methods_are_identical_and_sampled_ones_unchecked(result):
    for run in result["runs"]:
        if run["method"] in ("hf_sample", "lookahead_sample"):
            assert run["sampled"] and run["identical"] is None
        elif run["method"] != "hf_greedy":
            assert not run["sampled"] and run["identical"] is True


def test_speedups_against_greedy_mode_off_and_sampling(result):
    for per_method in result["summary"].values():
        look = per_method["lookahead"]
        for baseline in ("hf_greedy", "lookahead_off"):
            assert look[f"speedup_vs_{baseline}"] == pytest.approx(
                look["tokens_per_second"] / per_method[baseline]["tokens_per_second"])
        assert "speedup_vs_hf_greedy" not in per_method["lookahead_sample"]
        assert per_method["lookahead_sample"]["speedup_vs_hf_sample"] > 0
        assert look["expected_tokens_per_step"] >= 1.0 and look["rows_per_step"] >= 1.0
        assert per_method["hf_greedy"]["expected_tokens_per_step"] is None
    assert result["settings"]["ablation"]["lookahead_recycle"]["prompt_candidates"] == 0


def test_every_method_clocks_its_first_token(result):
    for run in result["runs"]:  # HF's own loops (streamer=) and lookahead's (lookahead_streamer=)
        assert 0 < run["first_token_seconds"] < run["seconds"], run["method"]
    for per_method in result["summary"].values():
        sampled = per_method["lookahead_sample"]
        assert sampled["speedup_decode_vs_hf_sample"] == pytest.approx(
            sampled["decode_tokens_per_second"] / per_method["hf_sample"]["decode_tokens_per_second"])
        assert set(sampled["speedup_decode_per_prompt_vs_hf_sample"]) <= {p.id for p in PROMPTS}


def test_decode_speedups_leave_out_the_prefill():
    # Same decode speed (0.1 s per token after the first), a 3 s prefill, outputs of 20 and 60 tokens: over the
    # whole call the shorter output looks 2.1x slower; from the first token on they are equal.
    def run(method, new_tokens, repeat):
        return {"prompt_id": "p", "category": "chat", "method": method, "new_tokens": new_tokens, "repeat": repeat,
                "seconds": 3.0 + 0.1 * (new_tokens - 1), "first_token_seconds": 3.0, "forwards": new_tokens,
                "identical": None, "sampled": True, "tokens": [0] * new_tokens}
    runs = [run("hf_sample", 60, r) for r in (0, 1)] + [run("lookahead_sample", 20, r) for r in (0, 1)]
    entry = harness.summarize(runs, ["hf_sample", "lookahead_sample"], (), ("hf_sample",))["all"]["lookahead_sample"]
    assert entry["speedup_vs_hf_sample"] == pytest.approx((20 / 4.9) / (60 / 8.9))
    assert entry["speedup_decode_vs_hf_sample"] == pytest.approx(1.0)
    assert entry["speedup_decode_per_prompt_vs_hf_sample"] == {"p": pytest.approx(1.0)}
    assert bench_generate.per_prompt_ratios(runs, "lookahead_sample", "hf_sample", decode=True) == {
        "p": (pytest.approx(1.0), pytest.approx(1.0))}
    assert bench_generate.per_prompt_ratios(runs, "lookahead_sample", "hf_sample")["p"][0] < 0.7
    unclocked = [dict(r, first_token_seconds=None) for r in runs]
    entry = harness.summarize(unclocked, ["hf_sample", "lookahead_sample"], (), ("hf_sample",))["all"]
    assert entry["lookahead_sample"]["decode_tokens_per_second"] is None
    assert "speedup_decode_vs_hf_sample" not in entry["lookahead_sample"]


def test_ablation_variants_use_only_their_drafter(result):
    for run in result["runs"]:
        accepted = set(run["stats"]["accepted_by_drafter"]) if run["stats"] else set()
        if run["method"] == "lookahead_prompt":
            assert accepted <= {"prompt"}
        if run["method"] == "lookahead_recycle":
            assert accepted <= {"recycle"}


def test_tables_cover_the_ablation_and_the_sampled_rows(result):
    table = bench_generate.format_tables(result)
    assert "× mode off (median / min)" in table
    assert "prompt: tok/step · × greedy" in table and "recycle: tok/step · × greedy" in table
    assert "all: tok/step · × greedy" in table and "category (sampled)" in table
    assert "Per prompt, lookahead_sample vs hf_sample from the first new token on: " in table
    firsts = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ")]
    assert firsts.count("| **all**") == 3  # main, ablation and sampled tables


def test_plots_include_calibration_and_ablation(result, tmp_path):
    pytest.importorskip("matplotlib")
    from plots import save_plots

    names = [p.name for p in save_plots(result, tmp_path / "run.json")]
    assert names == ["run-speedup.png", "run-tokens-per-step.png", "run-calibration.png", "run-ablation.png"]


class _Owner:
    """Stands in for a `Lookahead` that owns a recycling table."""

    def __init__(self):
        self.recycle_table = RecycleTable(2)
        self.recycle_table.ensure(8, 2)


def test_runs_of_a_prompt_start_from_the_table_before_its_first_run():
    owner = _Owner()
    table = owner.recycle_table
    tables = bench_generate.RecycleTables({"lookahead": {"custom_generate": owner}, "hf_greedy": {}}, enabled=True)
    tables.before_run("lookahead", "p0")  # first run of p0: the empty table is saved
    table.update(np.array([1]), np.array([[2, 3]]))  # what p0's run recycled
    tables.before_run("lookahead", "p1")
    assert table.known_tokens == 1  # p1 sees p0's predictions
    table.update(np.array([4]), np.array([[5, 6]]))
    tables.before_run("lookahead", "p0")  # p0's second run: back to the table before its first run
    assert table.known_tokens == 0
    tables.before_run("hf_greedy", "p0")  # methods without a table are left alone
    disabled = bench_generate.RecycleTables({"lookahead": {"custom_generate": owner}}, enabled=False)
    table.update(np.array([1]), np.array([[2, 3]]))
    disabled.before_run("lookahead", "p0")
    assert table.known_tokens == 1


def test_parse_args_ablation_and_sample():
    args = bench_generate.parse_args(["--categories", "code", "--prompts-per-category", "1", "--ablation",
                                      "--sample"])
    assert args.methods == ["hf_greedy", "hf_prompt_lookup", "lookahead", "lookahead_off", "lookahead_prompt",
                            "lookahead_pool", "lookahead_window", "lookahead_recycle", "hf_sample",
                            "lookahead_sample"]
