"""Attention backends over the paged KV cache, chosen by name.

Adding one (Triton, TileLang, FlashAttention...) is a new module with an `AttentionBackend` subclass
plus one line in `_BACKENDS`."""

from __future__ import annotations

import importlib

from runtime.gpu.attention.base import AttentionBackend

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


def get_attention_backend(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {available_backends()}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["AttentionBackend", "available_backends", "default_backend", "get_attention_backend"]
