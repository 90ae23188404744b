"""`fp8_linear`: a bf16 activation through an FP8 block-scaled weight, y = x W^T (+ bias), quantizing x
per token and 128-group on the fly. Both steps come from the registry (`fp8_act_quant`,
`fp8_block_gemm`), so DeepGEMM is used when importable."""

from __future__ import annotations

import torch

from runtime.gpu.kernels import registry


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] bf16/fp16 -> [..., N] in x's dtype (bf16 output for DeepGEMM)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    xq, xs = registry.get("fp8_act_quant", x.device)(x2)
    y = registry.get("fp8_block_gemm", x.device)(xq, xs, w, w_scale, out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], w.shape[0])
