"""GPU kernels as ops with several implementations, chosen per device by `registry`.

Each op is a package: `reference.py` (plain PyTorch, the truth), `triton.py` / `tilelang.py` (ours) or
a library adapter, and an `__init__` that declares the op (its contract, a Protocol, and its typed
`registry.Op` handle, e.g. `rms_norm.RMS_NORM`) and registers the implementations in preference order.
Importing this package registers every op."""

from runtime.gpu.kernels import (  # noqa: F401  (imported to register their implementations)
    decode_attention,
    extend_attention,
    fp8_gemm,
    fused_moe,
    index_scores,
    mhc,
    mla_decode,
    mla_prefill,
    moe_grouped_gemm,
    moe_route,
    rms_norm,
    rope,
    silu_and_mul,
    sparse_attention,
)
from runtime.gpu.kernels.registry import describe, op, ops

__all__ = ["describe", "op", "ops"]
