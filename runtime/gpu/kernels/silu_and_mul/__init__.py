"""The SwiGLU activation silu(gate) * up."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, triton_on_cuda


class SiluAndMul(Protocol):
    def __call__(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        rms_x: torch.Tensor | None = None,
        rms_eps: float = 0.0,
        limit: float | None = None,
    ) -> torch.Tensor:
        """gate, up: [T, I] (may be column slices of one [T, 2I] tensor). Returns silu(gate) * up [T, I]
        in gate's dtype, silu rounded to that dtype before the product. With `rms_x` [T, H]: gate and up
        came from a projection with the RMSNorm gain folded in, so each token's gate and up are first
        scaled by 1 / rms(rms_x[t]) (`rms_norm.reference.scale_by_inv_rms`, eps `rms_eps`). With `limit`
        (DeepSeek-V4's clamped SwiGLU), gate is clamped above and up on both sides first."""
        ...


SILU_AND_MUL = Op("silu_and_mul", SiluAndMul)
SILU_AND_MUL.register("triton", "runtime.gpu.kernels.silu_and_mul.triton:silu_and_mul", triton_on_cuda)
SILU_AND_MUL.register("reference", "runtime.gpu.kernels.silu_and_mul.reference:silu_and_mul", always)
