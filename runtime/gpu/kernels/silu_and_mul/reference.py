"""The SwiGLU activation in plain PyTorch."""

from __future__ import annotations

import torch.nn.functional as F

from runtime.gpu.kernels.rms_norm.reference import scale_by_inv_rms


def silu_and_mul(gate, up, rms_x=None, rms_eps=0.0, limit=None):
    """`SiluAndMul`."""
    if rms_x is not None:
        gate, up = scale_by_inv_rms(gate, rms_x, rms_eps), scale_by_inv_rms(up, rms_x, rms_eps)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up
