"""Named dummy presets: a config directory written on first use, read like any model directory."""

from __future__ import annotations

import pytest

from runtime.gpu import loader, presets


def test_llama_3_1_8b_preset_has_the_published_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path))
    c = loader.load_config("llama-3.1-8b")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (32, 4096, 14336)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (32, 8, 128256)
    assert c.max_position_embeddings == 131072
    assert c.rope_scaling["rope_type"] == "llama3"
    assert (tmp_path / "presets" / "llama-3.1-8b" / "config.json").is_file()


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model preset"):
        presets.preset_dir("llama-9")


def test_a_directory_path_is_not_taken_for_a_preset(tmp_path):
    assert presets.resolve(str(tmp_path)) == str(tmp_path)
