"""Sparse attention over selected rows (DeepSeek-V4, op `sparse_attention`): q [T, H, d] against the
shared K=V rows each token's index list names (its sliding window and compressed entries), with a
per-head sink. FlashMLA's `flash_mla_sparse_fwd` contract with values = keys. Triton on CUDA, then the
reference."""

from runtime.gpu.kernels.registry import always, register, triton_on_cuda

register(
    "sparse_attention",
    "triton",
    "runtime.gpu.kernels.sparse_attention.triton:sparse_attention",
    triton_on_cuda,
)
register(
    "sparse_attention", "reference", "runtime.gpu.kernels.sparse_attention.reference:sparse_attention", always
)
