"""The GGUF conversion yields a directory transformers (and we) can load, with a chat template."""

from __future__ import annotations

import json

from runtime.gpu.convert import is_complete


def test_converted_dir_loads_in_transformers_with_chat_template(smollm2_path, smollm2_hf):
    from transformers import AutoTokenizer

    assert is_complete(smollm2_path)
    assert "quantization_config" not in json.loads((smollm2_path / "config.json").read_text())
    assert smollm2_hf.config.model_type == "llama"
    tok = AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)
    assert tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert json.loads((smollm2_path / "tokenizer_config.json").read_text())["chat_template"]


def test_default_model_path_is_reused_once_converted(smollm2_path):
    from runtime.gpu.convert import default_model_path

    mtime = (smollm2_path / "model.safetensors").stat().st_mtime
    assert default_model_path() == smollm2_path
    assert (smollm2_path / "model.safetensors").stat().st_mtime == mtime
