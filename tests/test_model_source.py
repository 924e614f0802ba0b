"""Where a model stage's weights come from, including the loud tiny-model fallback."""

import logging

import pytest

from workers.backends.model_source import ModelUnavailable, resolve_model


def test_a_local_directory_is_used_as_is(tmp_path):
    assert resolve_model(str(tmp_path)) == (str(tmp_path), False)


def test_an_unavailable_model_without_fallback_is_an_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelUnavailable, match="no-such-org/no-such-model"):
        resolve_model("no-such-org/no-such-model")


def test_an_unavailable_model_falls_back_to_a_tiny_local_one(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with caplog.at_level(logging.WARNING, logger="duplexq.worker.model"):
        path, fallback = resolve_model("no-such-org/no-such-model", str(tmp_path / "tiny"))
    assert fallback
    assert (tmp_path / "tiny" / "config.json").exists()
    assert path == str(tmp_path / "tiny")
    assert "TINY model" in caplog.text and "no-such-org/no-such-model" in caplog.text
