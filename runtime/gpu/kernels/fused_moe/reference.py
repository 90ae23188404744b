"""Routed DeepSeekMoE experts in plain PyTorch (float32 math): the truth for `fused_moe`.

The (token, expert) pairs are sorted by expert and each expert runs one matmul pair over its contiguous
segment. The expert counts are read on the host (one sync per call), so this is not CUDA-graph safe;
the kernels build the same layout on the device (`layout.py`).

FP8 experts (W8A8, DeepSeek-V3's format, given `w13_scale` and `w2_scale`): e4m3 weights with float32
128x128 block scales (`weight_scale_inv`); each matmul's activation is quantized per token and per
128-group of K (`fp8_gemm.reference.act_quant`: x before gate/up, the bf16-rounded SwiGLU output before
down), and both operands are dequantized for a float32 matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.gpu.kernels.fp8_gemm.reference import GROUP, act_quant, dequant_act, dequant_weight


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with `limit` (DeepSeek-V4) gate is clamped above and up on both sides first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


def fused_moe(x, w13, w2, topk_weights, topk_ids, swiglu_limit=None, w13_scale=None, w2_scale=None):
    """`FusedMoe`."""
    fp8 = fp8_experts(w13, w2, w13_scale, w2_scale)
    num_tokens, k = topk_ids.shape
    num_experts = w13.shape[0]
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    token_of = order // k
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the host sync
    xs = (dequant_act(*act_quant(x)) if fp8 else x.float()).index_select(0, token_of)
    y = torch.empty(xs.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        w_up = dequant_weight(w13[e], w13_scale[e]) if fp8 else w13[e].float()
        w_down = dequant_weight(w2[e], w2_scale[e]) if fp8 else w2[e].float()
        gate, up = F.linear(xs[start : start + n], w_up).chunk(2, dim=-1)
        h = swiglu(gate, up, swiglu_limit).to(x.dtype)
        h = dequant_act(*act_quant(h)) if fp8 else h.float()
        y[start : start + n] = F.linear(h, w_down)
        start += n
    y = (y * topk_weights.reshape(-1)[order].float().unsqueeze(-1)).to(x.dtype).float()
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token_of, y).to(x.dtype)


def fp8_experts(
    w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None
) -> bool:
    """True for FP8 experts (both scales given), after checking the scales' 128x128 block grids."""
    if w13_scale is None and w2_scale is None:
        return False
    assert w13_scale is not None and w2_scale is not None, "FP8 experts need both w13_scale and w2_scale"
    (e, two_i, d), g = w13.shape, GROUP
    grids = (e, -(-two_i // g), -(-d // g)), (e, -(-d // g), -(-(two_i // 2) // g))
    assert (tuple(w13_scale.shape), tuple(w2_scale.shape)) == grids, (w13_scale.shape, w2_scale.shape, grids)
    return True
