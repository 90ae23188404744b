"""Adapter to DeepSeek's DeepGEMM (`deep_gemm`, built from source; the PyPI sdist lacks its CUDA
sources). Current API: `fp8_gemm_nt((x, x_scale), (w, w_scale), out)`, which converts the scale layouts
itself on SM90 (float32 scales, TMA-aligned transposed LHS scales); the early-2025 API
(`gemm_fp8_fp8_bf16_nt`) wants the LHS scales pre-transposed, done here. bf16 output only."""

from __future__ import annotations

import torch


def fp8_block_gemm(x_fp8, x_scale, w, w_scale, out_dtype=torch.bfloat16, out=None):
    """`Fp8BlockGemm` through DeepGEMM (bf16 out only)."""
    import deep_gemm as dg

    assert out_dtype == torch.bfloat16, "DeepGEMM writes bf16"
    out = (
        torch.empty(x_fp8.shape[0], w.shape[0], dtype=out_dtype, device=x_fp8.device) if out is None else out
    )
    if hasattr(dg, "fp8_gemm_nt"):
        dg.fp8_gemm_nt((x_fp8, x_scale.float()), (w, w_scale.float()), out)
    else:  # v1
        x_scale = dg.get_col_major_tma_aligned_tensor(x_scale.float())
        dg.gemm_fp8_fp8_bf16_nt((x_fp8, x_scale), (w, w_scale.float()), out)
    return out
