"""`fp8_linear`: a bf16 activation through an FP8 block-scaled weight, y = x W^T (+ bias).

Up to WEIGHT_ONLY_MAX_M rows (decode steps) and WEIGHT_ONLY_MAX_K input features, x is used as it is
(`fp8_weight_gemm`, W8A16: one launch, no activation rounding); otherwise x is quantized per token and
128-group on the fly and meets W in fp8 on the tensor cores (`fp8_act_quant` + `fp8_block_gemm`,
DeepGEMM when importable). All three come from the registry. A block-diagonal weight (`groups`,
DeepSeek-V4's o_a_proj) is one weight-only launch, or one block GEMM per group."""

from __future__ import annotations

import os

import torch

from runtime.gpu.kernels.fp8_gemm import FP8_ACT_QUANT, FP8_BLOCK_GEMM, FP8_WEIGHT_GEMM
from runtime.gpu.kernels.fp8_gemm.reference import GROUP

# Where x stays unquantized (W8A16), from `python -m benchmarks.kernels.fp8_weight_only` on the
# H200 (docs/PERF.md): at M <= 16 and K <= 2816 it was faster than W8A8 (TileLang), or within 0.9 us,
# at every V2-Lite/V3 projection (e.g. 8.5 vs 12.3 us at 5632x2048); at K = 7168 its unsplit K loop lost
# (20.5 vs 12.3 us at 1536x7168), and above 16 rows so did its 32-row tile.
WEIGHT_ONLY_MAX_M = 16
WEIGHT_ONLY_MAX_K = 4096


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None, groups: int = 1
) -> torch.Tensor:
    """x [..., K] bf16/fp16 -> [..., N] in x's dtype (bf16 output for DeepGEMM). `groups` > 1: a
    block-diagonal weight [N, K / groups] (`Fp8WeightGemm`'s groups; K / groups whole 128-groups)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    k = x2.shape[1] // groups
    if x2.shape[0] <= WEIGHT_ONLY_MAX_M and k <= WEIGHT_ONLY_MAX_K:
        y = FP8_WEIGHT_GEMM.get(x.device)(x2, w, w_scale, groups=groups)
    else:
        y = _quantized_gemm(x2, w, w_scale, groups)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], w.shape[0])


def _quantized_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, groups: int) -> torch.Tensor:
    """W8A8: x quantized per token and 128-group, then the block GEMM; with a block-diagonal weight once
    per group (prefill-sized M: compute-bound, so the extra launches cost little)."""
    quant, gemm = FP8_ACT_QUANT.get(x.device), FP8_BLOCK_GEMM.get(x.device)
    if groups == 1:
        return gemm(*quant(x), w, w_scale, out_dtype=x.dtype)
    k, rows = x.shape[1] // groups, w.shape[0] // groups
    assert rows % GROUP == 0, f"groups of {rows} rows are not whole scale blocks"
    parts = []
    for g in range(groups):
        w_g, ws_g = w[g * rows : (g + 1) * rows], w_scale[g * rows // GROUP : (g + 1) * rows // GROUP]
        parts.append(gemm(*quant(x[:, g * k : (g + 1) * k]), w_g, ws_g, out_dtype=x.dtype))
    return torch.cat(parts, dim=1)


def precompile(shapes: set[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> list[str]:
    """Compile, before the first request, the GEMM kernels that weights of `shapes` ((N, K) pairs) will
    use, where the registry's `fp8_block_gemm` builds a kernel per shape (TileLang: 5-10 s each, which a
    first prefill would otherwise wait for). Returns one log line per kernel; [] when there is nothing
    to compile."""
    if device.type != "cuda" or not shapes or FP8_BLOCK_GEMM.select(device).name != "tilelang":
        return []
    from runtime import envs
    from runtime.gpu.kernels.fp8_gemm import tilelang

    workers = max(1, min(8, (os.cpu_count() or 2) // 2))
    keys = tilelang.keys_for(shapes, dtype, device)
    return tilelang.precompile(keys, workers, marks=envs.cache_dir() / "kernels")
