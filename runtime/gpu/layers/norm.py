from __future__ import annotations

import torch
from torch import nn

from runtime.gpu.kernels.rms_norm import RMS_NORM


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the reference implementation.

    With `residual`, adds it first and returns (norm(x + residual), x + residual): the fused form decoder
    layers use. The op comes from the kernel registry (Triton on CUDA, the PyTorch reference elsewhere)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        res2 = None if residual is None else residual.reshape(-1, shape[-1])
        out = RMS_NORM.get(x.device)(x2, self.weight, self.eps, res2)
        if residual is None:
            return out.view(shape)
        y, h = out
        return y.view(shape), h.view(shape)
