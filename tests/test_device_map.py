"""Models split by `device_map` (accelerate: layers on the CPU and offloaded to disk, weights loaded by hooks at
each forward): lookahead is exact there too; placement options reach `from_pretrained` and bad ones fail
clearly."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from tiny_models import build_tiny_model, repetitive_prompt, word_tokenizer

import lookahead
from lookahead import LookaheadConfig
from lookahead.cli.main import main
from lookahead.models import ModelLoadError, load_model

SPLIT = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu",
         "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A saved tiny 4-layer Llama (fp32) with a word tokenizer."""
    path = tmp_path_factory.mktemp("device_map_model")
    build_tiny_model("llama", dtype=torch.float32, layers=4).save_pretrained(path)
    word_tokenizer(64).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def offloaded(folder, tmp_path_factory):
    """(the model loaded whole, the same model split over CPU and disk)."""
    whole, _ = load_model(folder)
    split, _ = load_model(folder, device_map=SPLIT, offload_folder=tmp_path_factory.mktemp("offload"))
    return whole, split


def test_disk_offloaded_model_is_really_split(offloaded):
    _, split = offloaded
    assert split.hf_device_map == SPLIT
    assert split.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # streamed in by a hook


@pytest.mark.parametrize("seed", range(3))
def test_offloaded_greedy_identical_to_plain_greedy(offloaded, seed):
    whole, split = offloaded
    prompt = repetitive_prompt(seed)
    plain = whole.generate(prompt, max_new_tokens=32, do_sample=False)
    decoder = lookahead.Lookahead(LookaheadConfig())
    fast = split.generate(prompt, max_new_tokens=32, do_sample=False, custom_generate=decoder)
    assert torch.equal(plain, fast)
    assert decoder.last_stats.steps < 31  # drafts were accepted: the comparison covers multi-token steps


def test_offloaded_batch_and_seeded_sampling_identical(offloaded):
    whole, split = offloaded
    prompts = torch.cat([repetitive_prompt(4), repetitive_prompt(5)])
    plain = whole.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=16, do_sample=False)
    fast = split.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=16, do_sample=False,
                          custom_generate=lookahead.Lookahead(LookaheadConfig()))
    assert torch.equal(plain, fast)
    sampled = [model.generate(repetitive_prompt(6), max_new_tokens=16, do_sample=True,
                              custom_generate=lookahead.Lookahead(LookaheadConfig(seed=3))) for model in offloaded]
    assert torch.equal(*sampled)


def test_placement_errors_are_clear(folder, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ModelLoadError, match="torchrun"):
        load_model(folder, tp_plan="auto")
    with pytest.raises(ModelLoadError, match="cannot be combined"):
        load_model(folder, tp_plan="auto", device_map="auto")
    with pytest.raises(ModelLoadError, match="device_map"):
        load_model(folder, offload_folder="/tmp/x")


def test_tensor_parallel_plan_goes_in_a_distributed_config(monkeypatch):
    """transformers deprecates `tp_plan=` in `from_pretrained` (a FutureWarning on every rank): the plan is
    passed inside `DistributedConfig`."""
    from transformers.distributed import DistributedConfig

    from lookahead import models

    monkeypatch.setenv("WORLD_SIZE", "2")
    placement = models._placement("auto", None, None)
    assert set(placement) == {"distributed_config"}
    assert isinstance(placement["distributed_config"], DistributedConfig)
    assert placement["distributed_config"].tp_plan == "auto"


def test_heads_the_ranks_cannot_split_are_refused_before_loading(tmp_path, monkeypatch):
    """3 key/value heads over 2 ranks: one clear error before any weight is read (not after the load)."""
    from transformers import AutoModelForCausalLM

    build_tiny_model("llama", dtype=torch.float32, layers=1, num_attention_heads=6, num_key_value_heads=3,
                     hidden_size=48).save_pretrained(tmp_path)
    word_tokenizer(64).save_pretrained(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")

    def no_load(*args, **kwargs):
        raise AssertionError("weights loaded before the head split was checked")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(ModelLoadError, match="3 key/value heads\\) cannot be split over 2 tensor-parallel ranks"):
        load_model(tmp_path, tp_plan="auto")


@pytest.mark.parametrize("args, message", [
    (["--tp"], "torchrun"),
    (["--device-map", "everywhere"], "--device-map: expected"),
    (["--device-map", "[1, 2]"], "--device-map: expected"),
    (["--offload-folder", "/tmp/x"], "--offload-folder needs a --device-map"),
    (["--tp", "--device-map", "auto"], "cannot be combined"),
])
def test_cli_placement_errors(folder, monkeypatch, args, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    result = CliRunner().invoke(main, ["generate", "--model", str(folder), *args, "w1 w2"])
    assert result.exit_code != 0 and message in result.output


def test_cli_device_map_generates_what_plain_greedy_does(folder, tmp_path):
    device_map = '{"model": "cpu", "lm_head": "disk"}'
    result = CliRunner().invoke(main, ["generate", "--model", str(folder), "--device-map", device_map,
                                       "--offload-folder", str(tmp_path), "--max-new-tokens", "12", "--compare",
                                       "w5 w6 w7 w8 w5 w6 w7"])
    assert result.exit_code == 0, result.output
    assert "outputs identical: yes" in result.output
