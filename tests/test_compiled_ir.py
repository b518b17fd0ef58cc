"""Tests for lookahead/compiled_ir.py: IR compiled for the host CPU, its object code cached on disk, intact or
ignored."""

from __future__ import annotations

import ctypes

import pytest

from lookahead import compiled_ir

IR = """define i64 @times_three_plus(i64 %x, i64 %y) {
  %t = mul i64 %x, 3
  %r = add i64 %t, %y
  ret i64 %r
}"""


def _call(address: int, x: int, y: int) -> int:
    return ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)(address)(x, y)


def _cached(tmp_path) -> list:
    return sorted((tmp_path / compiled_ir.SUBDIR).glob("probe-*.o"))


def _no_compiling(monkeypatch) -> None:
    import llvmlite.binding as llvm

    def refuse(*args, **kwargs):
        raise AssertionError("compiled although the object code was cached")

    monkeypatch.setattr(llvm, "create_pass_builder", refuse)


def test_the_object_code_is_cached_and_loaded_by_a_later_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    assert _call(compiled_ir.compiled_address(IR, "times_three_plus", "probe"), 5, 2) == 17
    assert len(_cached(tmp_path)) == 1
    with monkeypatch.context() as patched:
        _no_compiling(patched)
        assert _call(compiled_ir.compiled_address(IR, "times_three_plus", "probe"), 7, 1) == 22
    other = IR.replace("mul i64 %x, 3", "mul i64 %x, 4")  # other IR, other file
    assert _call(compiled_ir.compiled_address(other, "times_three_plus", "probe"), 5, 2) == 22
    assert len(_cached(tmp_path)) == 2


@pytest.mark.parametrize("damage", [lambda data: data[:-7], lambda data: data[:40] + b"\0" + data[41:],
                                    lambda data: b""])
def test_a_damaged_cache_file_is_ignored_and_written_again(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    compiled_ir.compiled_address(IR, "times_three_plus", "probe")
    path = _cached(tmp_path)[0]
    intact = path.read_bytes()
    path.write_bytes(damage(intact))
    assert _call(compiled_ir.compiled_address(IR, "times_three_plus", "probe"), 2, 3) == 9
    assert path.read_bytes() == intact


def test_an_unusable_cache_folder_only_costs_the_compile(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(blocker))
    assert _call(compiled_ir.compiled_address(IR, "times_three_plus", "probe"), 1, 1) == 4
