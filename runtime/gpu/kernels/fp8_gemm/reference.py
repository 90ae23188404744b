"""FP8 block-scaled GEMM and its activation quantizer in plain PyTorch (float32 math): the truth.

Format (DeepSeek-V3): weights W [N, K] float8_e4m3fn with `weight_scale_inv` [ceil(N/128), ceil(K/128)]
float32 (`runtime.gpu.quant.fp8`); activations quantized per token and per group of 128 along K:
x_fp8 [M, K] e4m3 with scales [M, ceil(K/128)] float32, x ~= x_fp8 * scale. y = x @ W^T."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128  # activation group and weight block along K (and weight block along N)
EPS = 1e-10  # amax floor: an all-zero group gets a tiny scale, not a division by zero


def act_quant(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K] e4m3, scales [M, ceil(K/group)] float32), per-group absmax / 448."""
    m, k = x.shape
    g = -(-k // group)
    xp = x.float().new_zeros(m, g * group)
    xp[:, :k] = x.float()
    blocks = xp.view(m, g, group)
    scale = (blocks.abs().amax(dim=-1).clamp(min=EPS) / FP8_MAX).float()
    q = (blocks / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(m, g * group)[:, :k]
    return q.to(FP8).contiguous(), scale


def dequant_act(x_fp8: torch.Tensor, scale: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    k = x_fp8.shape[1]
    return x_fp8.float() * scale.repeat_interleave(group, 1)[:, :k]


def dequant_weight(w: torch.Tensor, w_scale: torch.Tensor, block: int = GROUP) -> torch.Tensor:
    n, k = w.shape
    s = w_scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return w.float() * s


def fp8_block_gemm(x_fp8, x_scale, w, w_scale, out_dtype=torch.bfloat16, out=None):
    """`Fp8BlockGemm`: dequantized operands, a float32 matmul."""
    y = dequant_act(x_fp8, x_scale) @ dequant_weight(w, w_scale).T
    if out is None:
        return y.to(out_dtype)
    out.copy_(y)
    return out


def fp8_act_quant(x, group=GROUP):
    """`Fp8ActQuant`."""
    return act_quant(x, group)


def fp8_weight_gemm(x, w, w_scale, out=None, groups=1):
    """`Fp8WeightGemm`."""
    wd = dequant_weight(w, w_scale).view(groups, w.shape[0] // groups, w.shape[1])
    y = torch.einsum("mgk,gnk->mgn", x.float().view(x.shape[0], groups, -1), wd).flatten(1)
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out
