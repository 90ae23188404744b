"""Rotary position embedding (RoPE), with the frequency rescalings checkpoints declare."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(config) -> dict:
    """`rope_parameters` (transformers >= 5) or the older `rope_scaling` + `rope_theta` pair."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def inv_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    # on the CPU: models are built under `torch.device("meta")`, and these tables are real (meta ops would
    # also run torch's Python references, whose first call imports torch._dynamo: 2 s of a start-up)
    with torch.device("cpu"):
        return _inv_frequencies(config, head_dim)


def _inv_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    p = rope_parameters(config)
    kind = p["rope_type"]
    if kind in ("default", "llama3"):
        inv = 1.0 / (p["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return (_llama3_inv_freq(inv, p) if kind == "llama3" else inv), 1.0
    # Other static scalings (linear, yarn, ...): trust the reference implementation's formulas.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS or kind == "dynamic":
        raise NotImplementedError(f"rope_type {kind!r} is not supported")
    inv, scale = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv.float(), float(scale)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table for all positions; applied to q and k in the rotate-half layout."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.config, self.head_dim, self.max_positions = config, head_dim, max_positions
        self.build(None)

    def build(self, device: torch.device | str | None) -> None:
        """(Re)compute the tables in float32, e.g. after the module was created on the meta device."""
        inv_freq, scale = inv_frequencies(self.config, self.head_dim)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=inv_freq.device)
        emb = torch.outer(t, inv_freq)
        emb = torch.cat([emb, emb], dim=-1).to(device)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D], positions: [T]."""
        from runtime.gpu.kernels.rope import ROPE  # the op registry: fused Triton kernel on CUDA

        return ROPE.get(q.device)(positions, q, k, self.cos, self.sin)
