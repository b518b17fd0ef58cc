"""The model cache: two processes converting the default model at once must both succeed; a file that is not GGUF
is refused before any conversion is announced; transformers' loading bar only where loading takes a while."""

import pytest

from lookahead import models
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


def _saved_tiny_model(folder):
    from tiny_models import build_tiny_model, word_tokenizer

    build_tiny_model("llama", layers=1).save_pretrained(folder)
    word_tokenizer(64).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("quiet_below, bar_shown", [(1 << 30, False), (1, True)], ids=["small", "large"])
def test_transformers_loading_bar_is_shown_only_for_weights_that_take_a_while(tmp_path, monkeypatch, capsys,
                                                                               quiet_below, bar_shown):
    """A model whose weight files are under QUIET_LOAD_BYTES loads without transformers' progress bar (it would
    flicker for a fraction of a second on every CLI call); a larger one keeps it; the bars' switch is as before."""
    from transformers.utils import logging

    folder = _saved_tiny_model(tmp_path / "m")
    monkeypatch.setattr(models, "QUIET_LOAD_BYTES", quiet_below)
    assert logging.is_progress_bar_enabled()
    load_model(folder)
    assert ("Loading weights" in capsys.readouterr().err) == bar_shown
    assert logging.is_progress_bar_enabled()


def test_bars_switched_off_by_the_user_stay_off(tmp_path):
    from transformers.utils import logging

    folder = _saved_tiny_model(tmp_path / "m")
    logging.disable_progress_bar()
    try:
        load_model(folder)
        assert not logging.is_progress_bar_enabled()
    finally:
        logging.enable_progress_bar()
