"""Attention of each row's new tokens over its cached prefix plus the causal new part
(`extend_attention`), and of rows with no cached prefix over their own new tokens (`prefill_attention`)."""

from runtime.gpu.kernels.registry import always, register, triton_on_cuda

register(
    "extend_attention",
    "triton",
    "runtime.gpu.kernels.extend_attention.triton:extend_attention",
    triton_on_cuda,
)
register(
    "extend_attention", "reference", "runtime.gpu.kernels.extend_attention.reference:extend_attention", always
)
register(
    "prefill_attention",
    "triton",
    "runtime.gpu.kernels.extend_attention.triton:prefill_attention",
    triton_on_cuda,
)
register(
    "prefill_attention",
    "reference",
    "runtime.gpu.kernels.extend_attention.reference:prefill_attention",
    always,
)
