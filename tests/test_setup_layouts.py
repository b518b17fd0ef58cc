"""A generation builds its weights' layouts before its prefill (`hf.build_layouts`), and its stats report that
set-up apart from the prefill."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, repetitive_prompt

from lookahead import Lookahead, LookaheadConfig, affine_weights, argmax_head, streamed_gemm
from lookahead.decoder import Decoder
from lookahead.stats import DecodeStats


def _record_builds(monkeypatch) -> list[tuple[str, str]]:
    """(what, phase) for every streamed-panel pack and bounded head built from now on; phase "run" once a decoder
    runs (its prefill and steps), "before" until then."""
    phase, built = ["before"], []
    run = Decoder.run

    def spy_run(self):
        phase[0] = "run"
        return run(self)

    monkeypatch.setattr(Decoder, "run", spy_run)
    for module in (affine_weights, streamed_gemm):
        pack = module.pack_stacked
        monkeypatch.setattr(module, "pack_stacked",
                            lambda *args, _pack=pack, **kwargs: built.append(("panels", phase[0])) or _pack(*args,
                                                                                                             **kwargs))
    head = argmax_head.BoundedHead
    monkeypatch.setattr(argmax_head, "BoundedHead", lambda weight: built.append(("head", phase[0])) or head(weight))
    return built


@pytest.mark.parametrize("sample", [False, True])
def test_a_generation_builds_its_layouts_before_its_prefill(monkeypatch, sample):
    model = build_tiny_model("llama", dtype=torch.float32, seed=3)
    built = _record_builds(monkeypatch)
    decoder = Lookahead(seed=0) if sample else Lookahead()
    kwargs = {"do_sample": True, "top_k": 0} if sample else {"do_sample": False}
    model.generate(repetitive_prompt(3), max_new_tokens=12, custom_generate=decoder, **kwargs)
    layers = sum(1 for what, _ in built if what == "panels")
    assert layers > 0 and {phase for _, phase in built} == {"before"}, built
    # greedy steps read the LM head's bounded int8 copy, sampled ones its panels
    assert (("head", "before") in built) == (not sample)
    assert decoder.last_stats.setup_time > 0
    count = len(built)
    model.generate(repetitive_prompt(4), max_new_tokens=12, custom_generate=decoder, **kwargs)
    assert len(built) == count  # built once per model, kept while its weights stay the same


def test_stats_keep_the_set_up_apart():
    stats = DecodeStats(steps=4, new_tokens=9, step_tokens=8, setup_time=1.0, prefill_time=1.0, total_time=4.0)
    assert stats.decode_tokens_per_second == pytest.approx(4.0) and stats.tokens_per_second == pytest.approx(2.25)
    assert "time: set-up 1.00 s (once per process), prefill 1.00 s" in stats.summary()
    assert stats.as_dict()["setup_time"] == 1.0
    assert "set-up" not in DecodeStats(steps=1, new_tokens=2, step_tokens=1, total_time=1.0).summary()


def test_steps_that_never_reach_the_streamed_kernel_build_nothing(monkeypatch):
    # the tests' row kernels: 1-2 rows on the default matmul, 3-5 streamed; one-row steps and a 24-token prefill
    # never read the panels, so none are built (no memory for layouts the generation does not use)
    model = build_tiny_model("llama", dtype=torch.float32, seed=3)
    built = _record_builds(monkeypatch)
    model.generate(repetitive_prompt(3), max_new_tokens=12, custom_generate=Lookahead(LookaheadConfig.off()))
    assert built == []
