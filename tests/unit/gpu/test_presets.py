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


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("deepseek-v2-lite", (27, 2048, 16, 64, 6, 102400, None)),
        ("deepseek-v3", (61, 7168, 128, 256, 8, 129280, 1536)),
    ],
)
def test_deepseek_presets_have_the_published_shapes(tmp_path, monkeypatch, name, shape):
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path))
    c = loader.load_config(name)
    got = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.n_routed_experts)
    assert got + (c.num_experts_per_tok, c.vocab_size, c.q_lora_rank) == shape
    assert (c.kv_lora_rank, c.qk_rope_head_dim) == (512, 64)


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3"])
def test_a_cut_deepseek_preset_builds_with_dummy_weights(tmp_path, monkeypatch, name):
    """The preset cut to 2 layers (1 dense, 1 MoE) and narrowed builds and runs a forward on the CPU."""
    import torch

    from runtime.config import RunnerConfig
    from runtime.gpu.model_runner import ModelRunner
    from runtime.gpu.testing import PlanBuilder

    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path))
    small = {"num_hidden_layers": 2, "first_k_dense_replace": 1, "hidden_size": 256, "intermediate_size": 512,
             "moe_intermediate_size": 64, "n_routed_experts": 16, "n_group": 4, "topk_group": 2,
             "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
             "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "vocab_size": 512,
             "num_nextn_predict_layers": 0}  # fmt: skip
    if name == "deepseek-v2-lite":
        small |= {"q_lora_rank": None, "n_group": 1, "topk_group": 1}
    cfg = RunnerConfig(name, load_format="dummy", hf_overrides=small, num_kv_slots=64, max_reqs=2,
                       max_model_len=32, dtype="float32")  # fmt: skip
    runner = ModelRunner(cfg)
    logits = runner.forward_logits(PlanBuilder().plan([1], [0], [5], [3, 4, 5, 6, 7]))
    assert logits.shape == (1, 512) and torch.isfinite(logits).all()
