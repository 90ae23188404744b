"""Attention backends over the paged KV cache, chosen by name.

These are the multi-head attention backends (Llama family); MLA and DeepSeek-V4 backends live in their
model packages. Adding one (TileLang, FlashAttention...) is a new module with an `MHABackend` subclass
plus one line in `_BACKENDS`."""

from __future__ import annotations

import importlib

from runtime.gpu.attention.base import AttentionBackend, MHABackend

_BACKENDS: dict[str, str] = {
    "torch": "runtime.gpu.attention.torch_ref:TorchAttentionBackend",
    "triton": "runtime.gpu.attention.triton_backend:TritonAttentionBackend",
}


def default_backend(device: str | object) -> str:
    """Triton kernels on CUDA when Triton imports; the PyTorch reference elsewhere."""
    import torch

    from runtime.gpu.kernels.registry import has_module

    return "triton" if torch.device(device).type == "cuda" and has_module("triton") else "torch"


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> type[MHABackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {available_backends()}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["AttentionBackend", "MHABackend", "available_backends", "default_backend", "get_attention_backend"]
