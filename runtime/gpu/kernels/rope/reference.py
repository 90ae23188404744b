"""Rotary embedding in plain PyTorch, as `runtime.gpu.layers.rotary` applies it (rotate-half layout)."""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D], positions: [T]; cos, sin: float32 [max_pos, D] tables whose two
    halves repeat (RotaryEmbedding.cos / .sin). Returns new rotated (q, k)."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return _rotate(q, c, s), _rotate(k, c, s)
