"""RoPE factors from a table (`rope_table.py`): bit for bit what the model's rotary module gives for the same
positions, grown on demand, rebuilt when the frequencies change, and not used where the module's RoPE depends on more
than the position or its answers would differ from the table."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build_tiny_model

from lookahead import rope_table
from lookahead.rope_table import RopeTable


def _module_factors(rotary, positions: torch.Tensor):
    cos, sin = rotary(torch.zeros(1), position_ids=positions)
    half = sin.shape[-1] // 2
    return cos[0].numpy(), torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1).numpy()


def _equal_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.int32), b.view(np.int32))


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_rows_are_the_modules_factors_bit_for_bit(family):
    rotary = build_tiny_model(family, dtype=torch.float32).model.rotary_emb
    table = RopeTable(rotary)
    generator = torch.Generator().manual_seed(0)
    for positions in (torch.tensor([[0]]), torch.tensor([[255]]), torch.randint(0, 900, (1, 9), generator=generator),
                      torch.tensor([[40, 41, 41, 42, 43, 42]])):  # a tree step repeats depths
        cos, folded = table.factors(positions)
        want_cos, want_folded = _module_factors(rotary, positions)
        assert _equal_bits(cos, want_cos) and _equal_bits(folded, want_folded)
        assert cos.flags.c_contiguous and folded.flags.c_contiguous and cos.dtype == np.float32


def test_the_table_grows_to_the_positions_asked_for():
    table = RopeTable(build_tiny_model("llama", dtype=torch.float32).model.rotary_emb)
    table.factors(torch.tensor([[3]]))
    assert len(table._cos) == rope_table.MIN_POSITIONS
    table.factors(torch.tensor([[rope_table.MIN_POSITIONS]]))
    assert len(table._cos) == 2 * rope_table.MIN_POSITIONS
    table.factors(torch.tensor([[5000]]))
    assert len(table._cos) == 5001


def test_frequencies_changed_in_place_make_a_new_table():
    rotary = build_tiny_model("llama", dtype=torch.float32).model.rotary_emb
    table, positions = RopeTable(rotary), torch.tensor([[7, 100]])
    before = table.factors(positions)[0].copy()
    rotary.inv_freq.mul_(0.5)
    after = table.factors(positions)[0]
    assert not np.array_equal(before, after) and _equal_bits(after, _module_factors(rotary, positions)[0])


def test_other_rope_types_and_replaced_forwards_compute_every_step():
    scaled = build_tiny_model("llama", dtype=torch.float32,
                              rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert RopeTable(scaled.model.rotary_emb).factors(torch.tensor([[3]])) is None
    rotary = build_tiny_model("llama", dtype=torch.float32).model.rotary_emb
    rotary.forward = lambda x, position_ids: (None, None)
    assert RopeTable(rotary).factors(torch.tensor([[3]])) is None


def test_a_module_whose_answers_differ_from_the_table_is_not_tabled(monkeypatch):
    """The table is checked against the module's own answers for positions asked on their own: any difference (here
    a last-bit change in one run) and the table is never used for that module."""
    table = RopeTable(build_tiny_model("llama", dtype=torch.float32).model.rotary_emb)
    real = table._ask

    def ask(position_ids):
        cos, folded = real(position_ids)
        if position_ids.shape[1] == 5:
            cos = (cos.view(np.int32) ^ 1).view(np.float32)
        return cos, folded

    monkeypatch.setattr(table, "_ask", ask)
    assert table.factors(torch.tensor([[3]])) is None and not table.usable
    assert table.factors(torch.tensor([[3]])) is None


def test_negative_positions_are_left_to_the_module():
    table = RopeTable(build_tiny_model("llama", dtype=torch.float32).model.rotary_emb)
    assert table.factors(torch.tensor([[-1, 2]])) is None


def test_a_rotary_module_with_hooks_is_asked_every_step():
    rotary = build_tiny_model("llama", dtype=torch.float32).model.rotary_emb
    table = RopeTable(rotary)
    assert table.factors(torch.tensor([[3]])) is not None
    handle = rotary.register_forward_hook(lambda module, args, output: None)
    try:
        assert table.factors(torch.tensor([[3]])) is None
    finally:
        handle.remove()
