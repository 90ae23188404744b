"""RMSNorm (+ residual add) in plain PyTorch, rounding exactly like `runtime.gpu.layers.RMSNorm`."""

from __future__ import annotations

import torch


def inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / rms over the last dim, in float32, keeping that dim (size 1): the one formula every norm here
    shares."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x, weight, eps, residual=None):
    """`RmsNorm`."""
    if residual is not None:
        x = x + residual
    y = weight * (x.float() * inv_rms(x, eps)).to(x.dtype)
    return y if residual is None else (y, x)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, no weight: the mean square in float32, the product in x's dtype.
    DeepSeek-V4's per-head q norm and its mHC mixing input (there x is already float32)."""
    return x * inv_rms(x, eps).to(x.dtype)


def scale_by_inv_rms(y: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each token's row(s) of `y` [T, ...] times 1 / rms(x[t]) (x [T, H]), in float32, rounded to y's
    dtype. With RMSNorm's gain folded into the next projection's weight, proj(norm(x)) is
    proj_folded(x) scaled this way: the consumer of the projection applies it instead of a norm kernel
    (Llama `fold_norms`)."""
    inv = inv_rms(x, eps).view(-1, *([1] * (y.dim() - 1)))
    return (y.float() * inv).to(y.dtype)
