"""MLA decode (DeepSeek-V2/V3, absorbed form) on the paged latent cache: q [B, Hq, r + rope] against
one latent row per token, out [B, Hq, r]. FlashMLA when importable, then ours (TileLang on Hopper when
`import tilelang` works, Triton), then the reference.
`api.flash_mla_with_kvcache` is the FlashMLA call signature over the same choice."""

from runtime.gpu.kernels.registry import always, module_on_cuda, register, triton_on_cuda

register(
    "mla_decode",
    "flash_mla",
    "runtime.gpu.kernels.mla_decode.flash_mla:mla_decode",
    module_on_cuda("flash_mla"),
)


def _tilelang_on_hopper(device) -> bool:
    from runtime.gpu.kernels.mla_decode import tilelang  # light: tilelang itself is imported by the check

    return tilelang.available(device)


register("mla_decode", "tilelang", "runtime.gpu.kernels.mla_decode.tilelang:mla_decode", _tilelang_on_hopper)
register("mla_decode", "triton", "runtime.gpu.kernels.mla_decode.triton:mla_decode", triton_on_cuda)
register("mla_decode", "reference", "runtime.gpu.kernels.mla_decode.reference:mla_decode", always)
