"""Tests for lookahead/lean_layers.py: bit-identical logits to transformers' own decoder layers (same prepacked
products) on every supported architecture, for prefill, cached steps and tree-masked verification steps; the
layers' own forward for what the lean one does not handle; installed only where it applies and undone cleanly."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, repetitive_prompt, three_steps
from transformers import LogitsProcessor, LogitsProcessorList

from lookahead import Lookahead, LookaheadConfig
from lookahead.attention import tree_attention
from lookahead import lean_layers as lean
from lookahead.lean_layers import LeanForward, LeanNorm, lean_layers
from lookahead.packed_linear import packed_linears, set_default_rows

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")

ARCHITECTURES = {
    "llama": {},
    "qwen2": {},  # q/k/v with bias
    "llama-gelu": {"hidden_act": "gelu"},  # another activation: the MLP calls the module's own
    "llama-odd-width": {"intermediate_size": 100},  # SiLU's vector loop leaves tails (rounded otherwise)
    "mistral-sliding": {"sliding_window": 8},
    "qwen2-mixed": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
                    "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
}


def _model(name: str):
    family = name.split("-")[0]
    return build_tiny_model(family, dtype=torch.float32, seed=5, layers=3, **ARCHITECTURES[name])


def _forwards(model, prompt: torch.Tensor) -> list[torch.Tensor]:
    """Logits of a prefill, of a one-token cached step and of a tree-masked verification step (two branches)."""
    return three_steps(model, prompt)[0]


@pytest.mark.parametrize("default_rows", [0, 2], ids=["packed", "one-row-default-matmul"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_lean_layers_give_bit_identical_logits(name, default_rows):
    model = _model(name)
    prompt = repetitive_prompt(1, length=30)
    with torch.no_grad(), packed_linears(model), tree_attention(model):
        set_default_rows(model, default_rows)  # the one-row step on PyTorch's default matmul, the others packed
        own = _forwards(model, prompt)
        with lean_layers(model) as installed:
            assert installed == 3
            assert all(isinstance(layer.forward, LeanForward) for layer in model.model.layers)
            lean = _forwards(model, prompt)
    for expected, got in zip(own, lean, strict=True):
        assert torch.equal(expected, got)  # the same operations element for element: not merely close


def test_lean_layers_hand_gradients_training_and_attention_weights_to_the_own_forward():
    model = _model("llama")
    prompt = repetitive_prompt(2)
    own_calls = []
    with packed_linears(model), tree_attention(model), lean_layers(model):
        lean = model.model.layers[0].forward
        real_own = lean.own_forward
        lean.own_forward = lambda *args, **kwargs: own_calls.append(1) or real_own(*args, **kwargs)
        with torch.no_grad():
            model(prompt)
        assert own_calls == []  # an inference forward runs lean
        model(prompt).logits.sum().backward()  # gradients enabled and parameters trainable: the layer's own
        assert len(own_calls) == 1 and model.model.layers[0].mlp.down_proj.weight.grad is not None
        with torch.no_grad():
            model.train()
            model(prompt)
            model.eval()
            assert len(own_calls) == 2
            model.set_attn_implementation("eager")
            out = model(prompt, output_attentions=True)
            assert len(own_calls) == 3 and out.attentions[0] is not None


def test_lean_layers_are_installed_only_where_they_apply_and_removed_cleanly():
    model = _model("llama")
    with lean_layers(model) as installed:  # products not packed: nothing to do
        assert installed == 0
    with packed_linears(model), lean_layers(model, enabled=False) as installed:
        assert installed == 0
    for family in ("gemma", "phi3"):  # other layer formulas: left alone
        other = build_tiny_model(family, dtype=torch.float32, layers=2)
        with packed_linears(other), lean_layers(other) as installed:
            assert installed == 0
    hooked = _model("llama")
    hooked.model.layers[1].forward = hooked.model.layers[1].forward  # a forward of its own (e.g. accelerate's)
    with packed_linears(hooked), lean_layers(hooked) as installed:
        assert installed == 2
        with lean_layers(hooked) as nested:
            assert nested == 0
    assert "forward" not in hooked.model.layers[0].__dict__ and "forward" in hooked.model.layers[1].__dict__
    with pytest.raises(RuntimeError), packed_linears(model), lean_layers(model):
        raise RuntimeError("boom")
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)  # undone on error too


def test_lean_layers_need_the_standard_rotate_half(monkeypatch):
    """The lean RoPE folds `rotate_half`'s sign into the sin: an architecture whose `rotate_half` is another
    formula keeps its own forward."""
    import transformers.models.llama.modeling_llama as llama

    model = _model("llama")
    standard = llama.rotate_half
    monkeypatch.setattr(llama, "rotate_half", lambda x: torch.cat((x[..., 1::2], -x[..., ::2]), dim=-1))
    with packed_linears(model), lean_layers(model) as installed:
        assert installed == 0
    monkeypatch.setattr(llama, "rotate_half", standard)
    with packed_linears(model), lean_layers(model) as installed:
        assert installed == 3


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_lean_norm_is_the_modules_own_norm_bit_for_bit(family):
    norm = build_tiny_model(family, dtype=torch.float32, layers=1).model.layers[0].input_layernorm
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(norm.weight.shape, generator=gen))
        for rows in (1, 3, 8, 17, 64):
            for scale in (1e-4, 1.0, 50.0):
                x = torch.randn(2, rows, norm.weight.shape[0], generator=gen) * scale
                assert torch.equal(LeanNorm(norm)(x), norm(x))


def test_lean_layers_need_a_norm_they_compute_exactly(monkeypatch):
    """A norm class whose forward `LeanNorm` does not reproduce (here: eps added outside the square root) keeps
    the layer's own forward."""
    import transformers.models.llama.modeling_llama as llama

    model = _model("llama")
    monkeypatch.setattr(lean, "_NORM_CHECKED", {})
    monkeypatch.setattr(llama.LlamaRMSNorm, "forward",
                        lambda self, x: self.weight * (x / (x.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6)))
    with packed_linears(model), lean_layers(model) as installed:
        assert installed == 0


def test_silu_runs_in_place_only_for_silu_modules_computing_torchs_silu(monkeypatch):
    from transformers.activations import SiLUActivation

    monkeypatch.setattr(lean, "_SILU_CHECKED", {})
    assert lean._is_silu(torch.nn.SiLU()) and lean._is_silu(SiLUActivation())
    assert not lean._is_silu(torch.nn.GELU())
    patched = SiLUActivation()
    patched.forward = lambda x: x * torch.sigmoid(x)  # an instance forward of its own: left to it
    assert not lean._is_silu(patched)
    monkeypatch.setattr(torch.nn.SiLU, "forward", lambda self, x: torch.nn.functional.silu(x) * 1.0001)
    monkeypatch.setattr(lean, "_SILU_CHECKED", {})  # probed once per class: a fresh probe for the patched one
    assert not lean._is_silu(torch.nn.SiLU())  # a class that computes other numbers (probed)


class _LeanSpy(LogitsProcessor):
    """Records whether the model's first decoder layer ran the lean forward at each decoding step."""

    def __init__(self, model):
        self.model, self.seen = model, set()

    def __call__(self, input_ids, scores):
        self.seen.add(isinstance(self.model.model.layers[0].forward, LeanForward))
        return scores


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral-sliding"])
@pytest.mark.parametrize("config", [LookaheadConfig(), LookaheadConfig.off()], ids=["speculate", "off"])
def test_greedy_through_lean_layers_is_plain_greedy(name, config):
    model = _model(name)
    for seed in range(2):
        prompt = repetitive_prompt(seed)
        plain = model.generate(prompt, do_sample=False, max_new_tokens=40)
        spy = _LeanSpy(model)
        fast = model.generate(prompt, do_sample=False, max_new_tokens=40, custom_generate=Lookahead(config),
                              logits_processor=LogitsProcessorList([spy]))
        assert torch.equal(plain, fast)
        assert spy.seen == {True}  # the generation really ran the lean layers
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
