"""Attention of one new query token per row over its paged KV (flash-decoding split-KV)."""

from runtime.gpu.kernels.registry import always, register, triton_on_cuda

register(
    "decode_attention",
    "triton",
    "runtime.gpu.kernels.decode_attention.triton:decode_attention",
    triton_on_cuda,
)
register(
    "decode_attention", "reference", "runtime.gpu.kernels.decode_attention.reference:decode_attention", always
)
