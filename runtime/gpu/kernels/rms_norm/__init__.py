"""RMSNorm, optionally fused with the residual add before it."""

from runtime.gpu.kernels.registry import always, register, triton_on_cuda

register("rms_norm", "triton", "runtime.gpu.kernels.rms_norm.triton:rms_norm", triton_on_cuda)
register("rms_norm", "reference", "runtime.gpu.kernels.rms_norm.reference:rms_norm", always)
