"""Rotary position embedding (rotate-half / neox layout) on q and k in one pass."""

from runtime.gpu.kernels.registry import always, register, triton_on_cuda

register("rope", "triton", "runtime.gpu.kernels.rope.triton:rope", triton_on_cuda)
register("rope", "reference", "runtime.gpu.kernels.rope.reference:rope", always)
