"""benchmarks/bench_drafts.py: the timing-free drafting comparison."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_drafts  # noqa: E402  (the benchmarks folder is not a package)
from prompts import Prompt  # noqa: E402
from tiny_models import word_tokenizer  # noqa: E402

from lookahead.cost_curve import CURVE_SIZES, CostCurve  # noqa: E402

PROMPTS = [
    Prompt(id="t/0", category="code", text="w5 w9 w12 w7 w30 w5 w9 w12 w7 w41 w5 w9", chat=False),
    Prompt(id="t/1", category="chat", text="w20 w21 w22 w23 w20 w21 w22 w24 w20 w21", chat=True),
]
CHEAP = CostCurve(CURVE_SIZES, tuple(1.0 + 0.02 * (k - 1) for k in CURVE_SIZES), 0.05)


def test_variants_run_on_the_fixed_curve_and_summarize_what_they_did(tiny_model):
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    variants = [("all", {}), ("off", {"tree_budget": 0})]
    out = bench_drafts.run_variants(model, word_tokenizer(), PROMPTS, variants, CHEAP, 12, fresh_table=True,
                                    progress=False)
    assert len(out["runs"]) == len(PROMPTS) * len(variants)
    for run in out["runs"]:
        assert run["tokens"] == 11  # 12 new tokens, the prefill's first one not counted as a step's
        if run["variant"] == "off":
            assert run["rows"] == run["steps"] == 11 and run["cost"] == pytest.approx(11.0)
    summary = out["summary"]
    assert summary["off"]["all"]["tokens_per_step"] == 1.0 and summary["off"]["all"]["modeled_speed"] == 1.0
    all_runs = [r for r in out["runs"] if r["variant"] == "all"]
    expected = sum(r["tokens"] for r in all_runs) / sum(r["cost"] for r in all_runs)
    assert summary["all"]["all"]["modeled_speed"] == pytest.approx(expected)
    assert summary["all"]["all"]["rows_per_step"] > 1.0  # the cheap curve makes drafts worth verifying
    predicted = sum(r["predicted"] for r in all_runs) / sum(r["predicted_steps"] for r in all_runs)
    assert summary["all"]["all"]["predicted_per_step"] == pytest.approx(predicted) and predicted > 1.0
    assert summary["off"]["all"]["predicted_per_step"] == pytest.approx(1.0)  # nothing verified: 1 token
    table = bench_drafts.format_table({**out, "command": "python bench"})
    assert table.splitlines()[-1].startswith("| **all** |") and "| code |" in table


def test_a_variant_that_changes_the_output_is_reported(tiny_model, monkeypatch):
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    import lookahead.hf

    calls = []
    real = lookahead.hf.Lookahead.__call__

    def corrupt_second_variant(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append(1)
        if len(calls) > len(PROMPTS):
            out[0, -1] = (out[0, -1] + 1) % 50
        return out

    monkeypatch.setattr(lookahead.hf.Lookahead, "__call__", corrupt_second_variant)
    with pytest.raises(AssertionError, match="changed the output of t/0"):
        bench_drafts.run_variants(model, word_tokenizer(), PROMPTS, [("a", {}), ("b", {})], CHEAP, 6, False,
                                  progress=False)


def test_variant_parsing_and_errors(capsys):
    assert bench_drafts.parse_variant("nopool:pool_candidates=0,recycle_nodes=8") == \
        ("nopool", {"pool_candidates": 0, "recycle_nodes": 8})
    assert bench_drafts.parse_variant("base") == ("base", {})
    with pytest.raises(ValueError, match="needs a name"):
        bench_drafts.parse_variant(":pool_candidates=0")
    with pytest.raises(SystemExit):
        bench_drafts.parse_args(["--variant", "x:nope=1"])
    assert "unknown lookahead option 'nope'" in capsys.readouterr().err
    assert bench_drafts.parse_args([]).variants == [("defaults", {})]


def test_sampled_variants_are_seeded_so_their_outputs_agree(tiny_model):
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    variants = [("all", {}), ("off", {"tree_budget": 0}), ("small", {"tree_budget": 2})]
    out = bench_drafts.run_variants(model, word_tokenizer(), PROMPTS, variants, CHEAP, 12, fresh_table=True,
                                    progress=False, sample=True)  # raises if a variant drew other tokens
    assert len(out["runs"]) == len(PROMPTS) * len(variants)
    assert out["summary"]["off"]["all"]["tokens_per_step"] == 1.0
    greedy = bench_drafts.run_variants(model, word_tokenizer(), PROMPTS, variants[:1], CHEAP, 12, fresh_table=True,
                                       progress=False)
    assert greedy["summary"]["all"] != out["summary"]["all"]  # it did sample (greedy takes other steps)
