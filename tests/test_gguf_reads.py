"""`gguf_reads.shared_gguf_reads`: one GGUF reader per file and one name table per (arch, blocks) within the block,
the same converted model and tokenizer as without it, the `gguf` package's own functions back afterwards."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lookahead import models
from lookahead.gguf_reads import shared_gguf_reads

TOKENS = [chr(c) for c in range(33, 127)] + ["Ġ", "ĠĠ", "<s>", "</s>"]


def write_tiny_gguf(path: Path, seed: int = 0, layers: int = 2, width: int = 16, ffn: int = 32) -> Path:
    """A float32 Llama GGUF with a byte-level BPE tokenizer of 98 tokens (2 heads, 1 key-value head)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(64)
    writer.add_embedding_length(width)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * (len(TOKENS) - 2) + [3, 3])
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_bos_token_id(len(TOKENS) - 2)
    writer.add_eos_token_id(len(TOKENS) - 1)
    weights = {"token_embd.weight": (len(TOKENS), width), "output_norm.weight": (width,)}
    for i in range(layers):
        weights |= {f"blk.{i}.attn_norm.weight": (width,), f"blk.{i}.attn_q.weight": (width, width),
                    f"blk.{i}.attn_k.weight": (width // 2, width), f"blk.{i}.attn_v.weight": (width // 2, width),
                    f"blk.{i}.attn_output.weight": (width, width), f"blk.{i}.ffn_norm.weight": (width,),
                    f"blk.{i}.ffn_gate.weight": (ffn, width), f"blk.{i}.ffn_up.weight": (ffn, width),
                    f"blk.{i}.ffn_down.weight": (width, ffn)}
    for name, shape in weights.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def counted_readers(monkeypatch) -> list[str]:
    """The paths of every `gguf.GGUFReader` constructed (the package's own class, counted)."""
    made = []

    class Counted(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            made.append(str(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    return made


def _load(path: Path):
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_one_reader_per_file_within_the_block(tiny_gguf, tmp_path):
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)
    with shared_gguf_reads():
        first = gguf.GGUFReader(tiny_gguf)
        assert gguf.GGUFReader(str(tiny_gguf)) is first
        assert gguf.GGUFReader(tmp_path / "." / "tiny.gguf") is first  # the same file, spelt otherwise
        assert gguf.GGUFReader(other) is not first
    assert gguf.GGUFReader is not None and isinstance(gguf.GGUFReader, type)
    assert gguf.GGUFReader(tiny_gguf) is not gguf.GGUFReader(tiny_gguf)


def test_a_changed_file_is_read_again(tiny_gguf):
    with shared_gguf_reads():
        first = gguf.GGUFReader(tiny_gguf)
        write_tiny_gguf(tiny_gguf, seed=3)
        stat = tiny_gguf.stat()
        os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        again = gguf.GGUFReader(tiny_gguf)
    assert again is not first
    rewritten = (np.random.default_rng(3).standard_normal((len(TOKENS), 16)) * 0.1).astype(np.float32)
    assert np.array_equal(again.tensors[0].data, rewritten)  # the file as written now


def test_one_name_table_per_arguments():
    arch = gguf.MODEL_ARCH.LLAMA
    with shared_gguf_reads():
        table = gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 2) is table
        assert gguf.get_tensor_name_map(arch, 3) is not table
    fresh = gguf.get_tensor_name_map(arch, 2)
    assert fresh is not gguf.get_tensor_name_map(arch, 2)  # the package's own function again
    assert fresh.mapping == table.mapping


def test_the_package_functions_are_back_after_nesting_and_errors():
    own = gguf.GGUFReader, gguf.get_tensor_name_map
    with shared_gguf_reads():
        with shared_gguf_reads():
            inner = gguf.GGUFReader
        assert gguf.GGUFReader is inner  # the inner block's exit leaves the outer block's stand-ins
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == own
    with pytest.raises(RuntimeError, match="boom"), shared_gguf_reads():
        raise RuntimeError("boom")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == own


def test_transformers_reads_the_file_once_and_converts_the_same(tiny_gguf, counted_readers):
    plain_model, plain_tokenizer = _load(tiny_gguf)
    assert len(counted_readers) == 3  # config, weights, tokenizer: what the block saves (a negative control)
    del counted_readers[:]
    with shared_gguf_reads():
        model, tokenizer = _load(tiny_gguf)
    assert counted_readers == [str(tiny_gguf)]
    plain, shared = plain_model.state_dict(), model.state_dict()
    assert plain.keys() == shared.keys() and all(torch.equal(plain[k], shared[k]) for k in plain)
    text = "print('hi')  # twice  "
    assert tokenizer(text).input_ids == plain_tokenizer(text).input_ids
    assert tokenizer.get_vocab() == plain_tokenizer.get_vocab()


def test_a_user_gguf_converts_with_one_read(tiny_gguf, counted_readers, tmp_path, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    folder = models._converted_folder(tiny_gguf)
    assert counted_readers == [str(tiny_gguf)]
    model, _ = _load(tiny_gguf)
    saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
