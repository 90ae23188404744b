"""Attention of one new query token per row over its paged KV (flash-decoding split-KV)."""

from runtime.gpu.kernels.registry import always, register, tilelang_on_hopper, triton_on_cuda

# fp8 (e4m3) pools on Hopper: a stage 1 whose producer warpgroup owns the K/V pipeline; other pools and
# GPUs run the Triton kernel (the TileLang entry falls back to it itself)
register(
    "decode_attention",
    "tilelang",
    "runtime.gpu.kernels.decode_attention.tilelang:decode_attention",
    tilelang_on_hopper,
)
register(
    "decode_attention",
    "triton",
    "runtime.gpu.kernels.decode_attention.triton:decode_attention",
    triton_on_cuda,
)
register(
    "decode_attention", "reference", "runtime.gpu.kernels.decode_attention.reference:decode_attention", always
)
