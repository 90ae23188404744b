"""Paged decode attention in plain PyTorch, row by row in float32: the truth for the kernels."""

from __future__ import annotations

import torch


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None):
    """q: [L, Hq, D]; k, v: [S, Hkv, D]. Query i sees keys j <= causal_offset + i (all if None).
    Returns [L, Hq, D] in float32."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q.float().transpose(0, 1), kf.transpose(1, 2)) * scale  # [Hq, L, S]
    if causal_offset is not None:
        qi = torch.arange(q.shape[0], device=q.device)[:, None] + causal_offset
        allowed = torch.arange(k.shape[0], device=q.device)[None, :] <= qi
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vf).transpose(0, 1)


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    page_size: int = 1,
) -> torch.Tensor:
    """q: [B, Hq, D], one token per row; row b attends the KV slots req_to_token[rows[b], :seq_lens[b]]
    of k_pool/v_pool ([num_slots, Hkv, D]). Returns [B, Hq, D] in q's dtype. `num_splits` and
    `page_size` (the pool's) are ignored."""
    out = torch.empty_like(q) if out is None else out
    for b, (row, n) in enumerate(zip(rows.tolist(), seq_lens.tolist(), strict=True)):
        slots = req_to_token[row, :n]
        out[b] = attend(q[b : b + 1], k_pool[slots], v_pool[slots], scale, None)[0].to(q.dtype)
    return out
