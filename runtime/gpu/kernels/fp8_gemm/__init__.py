"""FP8 block-scaled GEMM (DeepSeek-V3 format: 1x128 activation scales, 128x128 weight scales), bf16
out, and the activation quantizer. DeepGEMM when importable, then ours (TileLang on Hopper when
`import tilelang` works, Triton), then the reference. `fp8_weight_gemm` is the weight-only (W8A16)
form for decode-sized M. `linear.fp8_linear` picks between them for a bf16 input.

Format (`reference.py`): weights W [N, K] float8_e4m3fn with `weight_scale_inv` [ceil(N/128),
ceil(K/128)] float32 (`runtime.gpu.quant.fp8`); activations quantized per token and per group of 128
along K: x_fp8 [M, K] e4m3 with scales [M, ceil(K/128)] float32, x ~= x_fp8 * scale. y = x @ W^T."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, module_on_cuda, tilelang_on_hopper, triton_on_cuda


class Fp8BlockGemm(Protocol):
    def __call__(
        self,
        x_fp8: torch.Tensor,
        x_scale: torch.Tensor,
        w: torch.Tensor,
        w_scale: torch.Tensor,
        out_dtype: torch.dtype = torch.bfloat16,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y [M, N] = dequant(x_fp8, x_scale) @ dequant(w, w_scale)^T, float32 accumulation, rounded to
        out_dtype (written into `out` [M, N], unit column stride, when given). x_fp8 [M, K] e4m3 (unit
        last stride), x_scale [M, ceil(K/128)] float32 (any strides, e.g. DeepGEMM's column-major
        layout), w [N, K] e4m3, w_scale [ceil(N/128), ceil(K/128)] float32. DeepGEMM writes bf16 only."""
        ...


class Fp8ActQuant(Protocol):
    def __call__(self, x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] (bf16/fp16/fp32, unit last stride) -> (x_fp8 [M, K] e4m3, scales [M, ceil(K/group)]
        float32): per token and group of `group` (128; kernels take only that) along K, scale =
        max(absmax, 1e-10) / 448 and x_fp8 = x / scale rounded to nearest even."""
        ...


class Fp8WeightGemm(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        w_scale: torch.Tensor,
        out: torch.Tensor | None = None,
        groups: int = 1,
    ) -> torch.Tensor:
        """W8A16: y [M, N] = x @ dequant(w, w_scale)^T in float32, x unquantized, rounded to x's dtype
        (`out` if given). x [M, K] bf16/fp16/fp32 (unit last stride), w [N, K] e4m3, w_scale
        [ceil(N/128), ceil(K/128)] float32. `groups` > 1: a block-diagonal weight (DeepSeek-V4's
        o_a_proj): x [M, groups * K], and output columns g*N/groups .. (g+1)*N/groups read x's
        columns g*K .. (g+1)*K (N/groups a multiple of 128)."""
        ...


FP8_BLOCK_GEMM = Op("fp8_block_gemm", Fp8BlockGemm)
FP8_BLOCK_GEMM.register(
    "deep_gemm", "runtime.gpu.kernels.fp8_gemm.deep_gemm:fp8_block_gemm", module_on_cuda("deep_gemm")
)
FP8_BLOCK_GEMM.register(
    "tilelang", "runtime.gpu.kernels.fp8_gemm.tilelang:fp8_block_gemm", tilelang_on_hopper
)
FP8_BLOCK_GEMM.register("triton", "runtime.gpu.kernels.fp8_gemm.triton:fp8_block_gemm", triton_on_cuda)
FP8_BLOCK_GEMM.register("reference", "runtime.gpu.kernels.fp8_gemm.reference:fp8_block_gemm", always)
FP8_ACT_QUANT = Op("fp8_act_quant", Fp8ActQuant)
FP8_ACT_QUANT.register("triton", "runtime.gpu.kernels.fp8_gemm.triton:fp8_act_quant", triton_on_cuda)
FP8_ACT_QUANT.register("reference", "runtime.gpu.kernels.fp8_gemm.reference:fp8_act_quant", always)
FP8_WEIGHT_GEMM = Op("fp8_weight_gemm", Fp8WeightGemm)
FP8_WEIGHT_GEMM.register("triton", "runtime.gpu.kernels.fp8_gemm.weight_only:fp8_weight_gemm", triton_on_cuda)
FP8_WEIGHT_GEMM.register("reference", "runtime.gpu.kernels.fp8_gemm.reference:fp8_weight_gemm", always)
