"""Weight loading: single files, sharded checkpoints, dummy weights and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import PlanBuilder, save_tiny_llama, seq_start


def small(path, **kw) -> RunnerConfig:
    return RunnerConfig(str(path), num_kv_slots=128, max_reqs=4, max_model_len=64, **kw)


def test_missing_model_dir_is_a_clear_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        ModelRunner(small(tmp_path / "nope"))


def test_missing_weights_file_is_a_clear_error(tmp_path):
    save_tiny_llama(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        ModelRunner(small(tmp_path))


def test_missing_tensor_is_named(tmp_path):
    save_tiny_llama(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight\[k_proj\]"):
        ModelRunner(small(tmp_path))


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    save_tiny_llama(single)
    save_tiny_llama(sharded)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, sharded / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = ModelRunner(small(single)), ModelRunner(small(sharded))
    for (na, pa), (nb, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_dummy_weights_need_only_config_and_run(tmp_path):
    save_tiny_llama(tmp_path, tie_word_embeddings=True)
    (tmp_path / "model.safetensors").unlink()
    runner = ModelRunner(small(tmp_path, load_format="dummy"))
    ids = [5, 6, 7]
    out = runner.execute(PlanBuilder().plan([1], [0], [3], ids, added=[seq_start(1, ids)]))
    assert len(out.tokens) == 1 and 0 <= out.tokens[0] < runner.vocab_size
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
