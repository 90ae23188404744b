"""Routed DeepSeekMoE experts (op `fused_moe`): device-side routing layout, gate/up GEMM with the SwiGLU
in its epilogue, down GEMM with the routing weights and unpermute in its epilogue; bf16 experts, FP8
ones (e4m3 with 128x128 block scales, activations quantized per token and 128-group: W8A8), or FP4 ones
(packed e2m1 with UE8M0 scales per 32, dequantized in the kernel against bf16 activations: W4A16). The Triton
path never reads the device on the host (CUDA-graph safe); the reference sorts on the host."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, triton_on_cuda


class FusedMoe(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        swiglu_limit: float | None = None,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, D]; w13 [E, 2I, D] (gate rows, then up rows); w2 [E, D, I] (unit stride along their last
        dim); topk_weights [T, k] (float32), topk_ids [T, k]. Returns
        sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) as [T, D] in x's dtype, where
        expert_e(x) = w2[e] (silu(gate) * up) with (gate, up) = w13[e] x (the `silu_and_mul` op's math;
        with `swiglu_limit`, DeepSeek-V4, gate is clamped above and up on both sides first). Rounded to x's
        dtype at the SwiGLU output (the down projection's input) and at each weighted expert output; the
        sum over k is float32.

        FP8 experts (W8A8, DeepSeek-V3's format): w13, w2 float8_e4m3fn with w13_scale
        [E, ceil(2I/128), ceil(D/128)] and w2_scale [E, ceil(D/128), ceil(I/128)] (float32, unit stride
        along K); each matmul's activation is quantized per token and 128-group of K
        (`fp8_gemm.reference.act_quant`: x before gate/up, the rounded SwiGLU output before down).

        FP4 experts (W4A16, DeepSeek-V4's format, `runtime.gpu.quant.fp4`): w13 [E, 2I, D/2] and w2
        [E, D, I/2] uint8, two e2m1 codes per byte (element 2j in the low nibble), with w13_scale
        [E, 2I, D/32] and w2_scale [E, D, I/32] uint8 UE8M0 exponents (2^(b - 127)), one per 32 along
        K (D and I multiples of 32); activations are not quantized: the float experts on the
        dequantized weights, which bf16 holds exactly. All four may instead be in their tiled form
        (`fp4.tile_experts`, 5-D: what `RoutedExperts` keeps on a GPU), which the mma kernels need."""
        ...


FUSED_MOE = Op("fused_moe", FusedMoe)
FUSED_MOE.register("triton", "runtime.gpu.kernels.fused_moe.triton:fused_moe", triton_on_cuda)
FUSED_MOE.register("reference", "runtime.gpu.kernels.fused_moe.reference:fused_moe", always)
