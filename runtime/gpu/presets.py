"""Named model shapes for `--load-format dummy`: performance work on a real architecture, no downloads.

`--model llama-3.1-8b --load-format dummy` runs the Llama-3.1-8B shape with random weights. A preset is
written once as a config.json directory under the cache dir, so everything that reads a model
directory (the loader, the frontend's model info) works unchanged. Presets have no tokenizer: the
frontend falls back to the embedded SmolLM2 one, whose ids (< 49152) fit each preset's vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

from runtime import envs

_LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    rms_norm_eps=1e-5,
    torch_dtype="bfloat16",
)

PRESETS: dict[str, dict] = {
    "llama-3.1-8b": dict(
        _LLAMA,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
    "llama-3.2-1b": dict(
        _LLAMA,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
}


def is_preset(name: str | None) -> bool:
    return name in PRESETS


def preset_dir(name: str) -> Path:
    """The directory holding the preset's config.json, written on first use."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    path = envs.cache_dir() / "presets" / name
    cfg = path / "config.json"
    text = json.dumps(PRESETS[name], indent=2, sort_keys=True)
    if not cfg.is_file() or cfg.read_text() != text:
        path.mkdir(parents=True, exist_ok=True)
        tmp = cfg.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(cfg)
    return path


def resolve(model: str) -> str:
    """A model directory for `model`: a preset name becomes its config directory; a path stays."""
    if not Path(model).exists() and is_preset(model):
        return str(preset_dir(model))
    return model
