"""The SwiGLU activation in plain PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.gpu.kernels.rms_norm.reference import scale_by_inv_rms


def silu_and_mul(
    gate: torch.Tensor, up: torch.Tensor, rms_x: torch.Tensor | None = None, rms_eps: float = 0.0
) -> torch.Tensor:
    """gate, up: [T, I] (may be column slices of one [T, 2I] tensor). Returns silu(gate) * up.
    With `rms_x` [T, H]: gate and up came from a projection with the RMSNorm gain folded in, so each
    token's gate and up are first scaled by 1 / rms(rms_x[t]) (`scale_by_inv_rms`)."""
    if rms_x is not None:
        gate, up = scale_by_inv_rms(gate, rms_x, rms_eps), scale_by_inv_rms(up, rms_x, rms_eps)
    return F.silu(gate) * up
