"""Grouped MoE GEMM, contiguous layout (tokens sorted by expert, one launch over all experts), bf16."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, triton_on_cuda


class MoeGroupedGemm(Protocol):
    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, K] sorted by expert (unit last stride); w [E, N, K]; offsets [E + 1] (int, offsets[0] = 0,
        offsets[E] = T): rows offsets[e] .. offsets[e + 1] of x go through expert e, y = x W_e^T with
        float32 accumulation. Returns y [T, N] in x's dtype (`out` if given)."""
        ...


MOE_GROUPED_GEMM = Op("moe_grouped_gemm", MoeGroupedGemm)
MOE_GROUPED_GEMM.register(
    "triton", "runtime.gpu.kernels.moe_grouped_gemm.triton:moe_grouped_gemm", triton_on_cuda
)
MOE_GROUPED_GEMM.register(
    "reference", "runtime.gpu.kernels.moe_grouped_gemm.reference:moe_grouped_gemm", always
)
