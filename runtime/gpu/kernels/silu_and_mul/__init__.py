"""The SwiGLU activation silu(gate) * up."""

from runtime.gpu.kernels.registry import always, register, triton_on_cuda

register("silu_and_mul", "triton", "runtime.gpu.kernels.silu_and_mul.triton:silu_and_mul", triton_on_cuda)
register("silu_and_mul", "reference", "runtime.gpu.kernels.silu_and_mul.reference:silu_and_mul", always)
