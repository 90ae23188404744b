"""FP8 block-scaled GEMM (DeepSeek-V3 format: 1x128 activation scales, 128x128 weight scales), bf16
out, and the activation quantizer. DeepGEMM when importable, then ours (TileLang on Hopper when
`import tilelang` works, Triton), then the reference. `fp8_weight_gemm` is the weight-only (W8A16)
form for decode-sized M. `linear.fp8_linear` picks between them for a bf16 input."""

from runtime.gpu.kernels.registry import always, module_on_cuda, register, tilelang_on_hopper, triton_on_cuda

register(
    "fp8_block_gemm",
    "deep_gemm",
    "runtime.gpu.kernels.fp8_gemm.deep_gemm:fp8_block_gemm",
    module_on_cuda("deep_gemm"),
)
register(
    "fp8_block_gemm", "tilelang", "runtime.gpu.kernels.fp8_gemm.tilelang:fp8_block_gemm", tilelang_on_hopper
)
register("fp8_block_gemm", "triton", "runtime.gpu.kernels.fp8_gemm.triton:fp8_block_gemm", triton_on_cuda)
register("fp8_block_gemm", "reference", "runtime.gpu.kernels.fp8_gemm.reference:fp8_block_gemm", always)
register("fp8_act_quant", "triton", "runtime.gpu.kernels.fp8_gemm.triton:fp8_act_quant", triton_on_cuda)
register("fp8_act_quant", "reference", "runtime.gpu.kernels.fp8_gemm.reference:fp8_act_quant", always)
register(
    "fp8_weight_gemm", "triton", "runtime.gpu.kernels.fp8_gemm.weight_only:fp8_weight_gemm", triton_on_cuda
)
register("fp8_weight_gemm", "reference", "runtime.gpu.kernels.fp8_gemm.reference:fp8_weight_gemm", always)
