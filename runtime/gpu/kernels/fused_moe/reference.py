"""Routed DeepSeekMoE experts in plain PyTorch (float32 math): the truth for `fused_moe`.

The (token, expert) pairs are sorted by expert and each expert runs one matmul pair over its contiguous
segment. The expert counts are read on the host (one sync per call), so this is not CUDA-graph safe;
the kernels build the same layout on the device (`layout.py`).

FP8 experts (W8A8, DeepSeek-V3's format, given `w13_scale` and `w2_scale`): e4m3 weights with float32
128x128 block scales (`weight_scale_inv`); each matmul's activation is quantized per token and per
128-group of K (`fp8_gemm.reference.act_quant`: x before gate/up, the bf16-rounded SwiGLU output before
down), and both operands are dequantized for a float32 matmul.

FP4 experts (W4A16, DeepSeek-V4's format, given uint8 weights and scales): packed e2m1 codes with one
UE8M0 scale per 32 along K (`runtime.gpu.quant.fp4`), dequantized for a float32 matmul against the
unquantized activations: the float path on the dequantized weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.gpu.kernels.fp8_gemm.reference import GROUP, act_quant, dequant_act, dequant_weight
from runtime.gpu.kernels.silu_and_mul.reference import silu_and_mul
from runtime.gpu.quant import fp4


def fused_moe(x, w13, w2, topk_weights, topk_ids, swiglu_limit=None, w13_scale=None, w2_scale=None):
    """`FusedMoe`."""
    fmt = expert_format(w13, w2, w13_scale, w2_scale)
    num_tokens, k = topk_ids.shape
    num_experts = w13.shape[0]
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    token_of = order // k
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the host sync
    w8a8 = fmt == "fp8"
    xs = (dequant_act(*act_quant(x)) if w8a8 else x.float()).index_select(0, token_of)
    hidden = fp4.stacked_shape(w13)[2] * 2 if fmt == "fp4" else w13.shape[2]
    y = torch.empty(xs.shape[0], hidden, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        w_up = _dequantized(fmt, w13, w13_scale, e)
        w_down = _dequantized(fmt, w2, w2_scale, e)
        gate, up = F.linear(xs[start : start + n], w_up).chunk(2, dim=-1)
        h = silu_and_mul(gate, up, limit=swiglu_limit).to(x.dtype)
        h = dequant_act(*act_quant(h)) if w8a8 else h.float()
        y[start : start + n] = F.linear(h, w_down)
        start += n
    y = (y * topk_weights.reshape(-1)[order].float().unsqueeze(-1)).to(x.dtype).float()
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    return out.index_add_(0, token_of, y).to(x.dtype)


def _dequantized(fmt: str, w: torch.Tensor, scale: torch.Tensor | None, e: int) -> torch.Tensor:
    """Expert e of a stack as float32 [N, K]."""
    if fmt == "fp8":
        return dequant_weight(w[e], scale[e])
    if fmt == "fp4":  # either form (`fp4.tile_experts`), one expert row-major at a time
        return fp4.dequantize(fp4.row_major(w[e : e + 1])[0], fp4.row_major(scale[e : e + 1])[0])
    return w[e].float()


def expert_format(
    w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None
) -> str:
    """ "float" (no scales), "fp8" (e4m3 experts, after checking the scales' 128x128 block grids) or
    "fp4" (packed uint8 experts, row-major or tiled, after checking one scale byte per row and 32 along
    K)."""
    if w13_scale is None and w2_scale is None:
        return "float"
    assert w13_scale is not None and w2_scale is not None, (
        "quantized experts need both w13_scale and w2_scale"
    )
    if w13.dtype == fp4.PACKED:
        tiled = {fp4.is_tiled(t) for t in (w13, w2, w13_scale, w2_scale)}
        assert len(tiled) == 1, "FP4 experts' codes and scales are all tiled (`fp4.tile_experts`) or none"
        (e, two_i, half_d), g = fp4.stacked_shape(w13), fp4.GROUP
        d, i = 2 * half_d, two_i // 2
        shapes = (e, d, i // 2), (e, two_i, d // g), (e, d, i // g)
        got = tuple(fp4.stacked_shape(t) for t in (w2, w13_scale, w2_scale))
        assert got == shapes and d % g == 0 and i % g == 0, (got, shapes)
        assert w2.dtype == w13_scale.dtype == w2_scale.dtype == fp4.PACKED
        return "fp4"
    (e, two_i, d), g = w13.shape, GROUP
    grids = (e, -(-two_i // g), -(-d // g)), (e, -(-d // g), -(-(two_i // 2) // g))
    assert (tuple(w13_scale.shape), tuple(w2_scale.shape)) == grids, (w13_scale.shape, w2_scale.shape, grids)
    return "fp8"
