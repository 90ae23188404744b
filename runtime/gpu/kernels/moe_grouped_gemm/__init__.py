"""Grouped MoE GEMM, contiguous layout (tokens sorted by expert, one launch over all experts), bf16."""

from runtime.gpu.kernels.registry import always, register, triton_on_cuda

register(
    "moe_grouped_gemm",
    "triton",
    "runtime.gpu.kernels.moe_grouped_gemm.triton:moe_grouped_gemm",
    triton_on_cuda,
)
register(
    "moe_grouped_gemm", "reference", "runtime.gpu.kernels.moe_grouped_gemm.reference:moe_grouped_gemm", always
)
