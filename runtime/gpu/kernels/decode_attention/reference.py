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
    q, k_pool, v_pool, req_to_token, rows, seq_lens, scale, num_splits=None, out=None, page_size=1, q_len=1
):
    """`DecodeAttention`, row by row."""
    out = torch.empty_like(q) if out is None else out
    for b, (row, n) in enumerate(zip(rows.tolist(), seq_lens.tolist(), strict=True)):
        slots = req_to_token[row, :n]
        qb = q[b * q_len : (b + 1) * q_len]
        out[b * q_len : (b + 1) * q_len] = attend(qb, k_pool[slots], v_pool[slots], scale, n - q_len).to(
            q.dtype
        )
    return out
