"""Routed DeepSeekMoE experts (op `fused_moe`): device-side routing layout, gate/up GEMM with the SwiGLU
in its epilogue, down GEMM with the routing weights and unpermute in its epilogue; bf16 experts, or FP8
ones (e4m3 with 128x128 block scales, activations quantized per token and 128-group: W8A8). The Triton
path never reads the device on the host (CUDA-graph safe); the reference sorts on the host."""

from runtime.gpu.kernels.registry import always, register, triton_on_cuda

register("fused_moe", "triton", "runtime.gpu.kernels.fused_moe.triton:fused_moe", triton_on_cuda)
register("fused_moe", "reference", "runtime.gpu.kernels.fused_moe.reference:fused_moe", always)
