"""The model cache: two processes converting the default model at once must both succeed; a file that is not GGUF
is refused before any conversion is announced."""

import pytest

from lookahead.models import ModelLoadError, _publish, load_model


def _finished(path, marker: str):
    path.mkdir()
    (path / "config.json").write_text(marker)
    return path


def test_publish_renames_the_finished_folder(tmp_path):
    partial = _finished(tmp_path / "model.part-a", "mine")
    _publish(partial, tmp_path / "model")
    assert (tmp_path / "model" / "config.json").read_text() == "mine"
    assert not partial.exists()


def test_publish_keeps_the_folder_another_process_published_first(tmp_path):
    _finished(tmp_path / "model", "first")
    partial = _finished(tmp_path / "model.part-b", "second")
    _publish(partial, tmp_path / "model")
    assert (tmp_path / "model" / "config.json").read_text() == "first"
    assert not partial.exists()  # the loser's copy is cleaned up


def test_publish_does_not_hide_a_real_failure(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "stray").write_text("not a model")  # occupied, but by no published model
    partial = _finished(tmp_path / "model.part-c", "mine")
    with pytest.raises(OSError):
        _publish(partial, tmp_path / "model")
    assert partial.exists()


def test_a_gguf_name_without_gguf_content_is_refused_before_converting(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / "notes.gguf"
    fake.write_bytes(b"this is text, not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(fake)
    assert "converting" not in capsys.readouterr().err
    assert not (tmp_path / "cache" / "models").exists()
