"""DeepSeekMoE routing (op `moe_route`): scores, group-limited top-k with correction bias, weights. One
Triton program per token on CUDA instead of a dozen small torch ops per MoE layer."""

from runtime.gpu.kernels.registry import always, register, triton_on_cuda

register("moe_route", "triton", "runtime.gpu.kernels.moe_route.triton:moe_route", triton_on_cuda)
register("moe_route", "reference", "runtime.gpu.kernels.moe_route.reference:moe_route", always)
