"""mHC (DeepSeek-V4 hyper-connections) around each sublayer: `mhc_pre` collapses the hc_mult residual
streams into the sublayer's input (optionally RMS-normed) and gives the post / comb mixings, `mhc_post`
spreads the sublayer's output back over the streams and mixes them. The math lives in `reference.py`;
`runtime.gpu.models.deepseek_v4.mhc` calls these ops."""

from runtime.gpu.kernels.registry import always, register, triton_on_cuda

register("mhc_pre", "triton", "runtime.gpu.kernels.mhc.triton:mhc_pre", triton_on_cuda)
register("mhc_pre", "reference", "runtime.gpu.kernels.mhc.reference:mhc_pre", always)
register("mhc_post", "triton", "runtime.gpu.kernels.mhc.triton:mhc_post", triton_on_cuda)
register("mhc_post", "reference", "runtime.gpu.kernels.mhc.reference:mhc_post", always)
