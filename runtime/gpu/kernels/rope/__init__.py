"""Rotary position embedding (rotate-half / neox layout) on q and k in one pass; `rope_store` also
writes k and v into the paged KV pools (the fused form the Triton attention backend uses)."""

from runtime.gpu.kernels.registry import always, register, triton_on_cuda

register("rope", "triton", "runtime.gpu.kernels.rope.triton:rope", triton_on_cuda)
register("rope", "reference", "runtime.gpu.kernels.rope.reference:rope", always)
register("rope_store", "triton", "runtime.gpu.kernels.rope.triton:rope_store", triton_on_cuda)
register("rope_store", "reference", "runtime.gpu.kernels.rope.reference:rope_store", always)
