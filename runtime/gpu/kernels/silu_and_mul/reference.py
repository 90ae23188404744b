"""The SwiGLU activation in plain PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [T, I] (may be column slices of one [T, 2I] tensor). Returns silu(gate) * up."""
    return F.silu(gate) * up
