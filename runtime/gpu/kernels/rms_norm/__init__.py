"""RMSNorm, optionally fused with the residual add before it."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, triton_on_cuda


class RmsNorm(Protocol):
    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (and residual [T, H], same dtype), weight [H]. Without `residual`: weight * norm(x),
        norm(x) = x / rms(x) over H with the mean square in float32. With it: h = x + residual, rounded to
        x's dtype, and returns (weight * norm(h), h), h being the next layer's residual. The normalised
        row is rounded to x's dtype before the weight multiply (as `runtime.gpu.layers.RMSNorm`); the
        output dtype is promote(x, weight)."""
        ...


RMS_NORM = Op("rms_norm", RmsNorm)
RMS_NORM.register("triton", "runtime.gpu.kernels.rms_norm.triton:rms_norm", triton_on_cuda)
RMS_NORM.register("reference", "runtime.gpu.kernels.rms_norm.reference:rms_norm", always)
