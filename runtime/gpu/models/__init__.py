"""Model registry: `config.architectures[0]` -> its family's `CausalLM` (one package per family)."""

from __future__ import annotations

import importlib

from runtime.gpu.models.base import CausalLM, ModelAbilities

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "runtime.gpu.models.llama:LlamaForCausalLM",
    # V2 / V2-Lite / V2.5 are V3's model with V2 routing, which TopkRouter reads from the config
    "DeepseekV2ForCausalLM": "runtime.gpu.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV3ForCausalLM": "runtime.gpu.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV4ForCausalLM": "runtime.gpu.models.deepseek_v4:DeepseekV4ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config) -> type[CausalLM]:
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else ("LlamaForCausalLM" if config.model_type == "llama" else None)
    if arch not in _MODELS:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {supported_architectures()}")
    module, cls = _MODELS[arch].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["CausalLM", "ModelAbilities", "get_model_class", "supported_architectures"]
