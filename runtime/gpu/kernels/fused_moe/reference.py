"""Routed DeepSeekMoE experts in plain PyTorch (float32 math): the truth for `fused_moe`.

The (token, expert) pairs are sorted by expert and each expert runs one matmul pair over its contiguous
segment. The expert counts are read on the host (one sync per call), so this is not CUDA-graph safe;
the kernels build the same layout on the device (`layout.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with `limit` (DeepSeek-V4) gate is clamped above and up on both sides first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """x [T, D]; w13 [E, 2I, D] (gate rows, then up rows); w2 [E, D, I]; topk_weights [T, k] (float32),
    topk_ids [T, k]. Returns sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) as [T, D] in x's
    dtype. The points where the kernels round to x's dtype are rounded here too: the SwiGLU output
    (the down projection's input) and each weighted expert output; the sum over k is float32."""
    num_tokens, k = topk_ids.shape
    num_experts = w13.shape[0]
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    token_of = order // k
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the host sync
    xs = x.index_select(0, token_of).float()
    y = torch.empty(xs.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        gate, up = F.linear(xs[start : start + n], w13[e].float()).chunk(2, dim=-1)
        h = swiglu(gate, up, swiglu_limit).to(x.dtype).float()
        y[start : start + n] = F.linear(h, w2[e].float())
        start += n
    y = (y * topk_weights.reshape(-1)[order].float().unsqueeze(-1)).to(x.dtype).float()
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token_of, y).to(x.dtype)
