"""Tiny random Llama checkpoints (transformers writes them, our loader reads them)."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
        architectures=["LlamaForCausalLM"],
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def save_tiny_llama(path: Path, seed: int = 0, **overrides):
    """A real checkpoint directory (config.json + model.safetensors) of a random tiny Llama."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = tiny_llama_config(**overrides)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # default init leaves norms at 1; randomize so a norm bug shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model
