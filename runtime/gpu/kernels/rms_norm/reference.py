"""RMSNorm (+ residual add) in plain PyTorch, rounding exactly like `runtime.gpu.layers.RMSNorm`."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H]. Without `residual`: weight * norm(x). With it: h = x + residual (in x's dtype), returns
    (weight * norm(h), h), h being the next layer's residual."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    y = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (y, x)
