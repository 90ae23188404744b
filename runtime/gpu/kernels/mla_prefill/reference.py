"""MLA prefill (expanded form) in plain PyTorch, row by row in float32: the truth for the kernels.

Row b's queries q[q_starts[b] : + q_lens[b]] are the last q_lens[b] positions of its keys
k[kv_starts[b] : + kv_lens[b]] (the first kv_lens[b] - q_lens[b] are its cached prefix), so query i sees
keys 0 .. prefix + i. Keys and values are per head (the latents expanded by W_UK / W_UV, k_pe
broadcast), with head dims d_qk (= nope + rope, 192 for DeepSeek-V3) and d_v (128) that differ."""

from __future__ import annotations

import torch

SCORES_BUDGET = 1 << 28  # bytes of float32 scores per step: long rows are attended a query chunk at a time


def mla_prefill(q, k, v, q_starts, q_lens, kv_starts, kv_lens, scale, max_q_len=None, out=None):
    """`MlaPrefill`, row by row, a chunk of queries at a time on long rows."""
    heads, dv = q.shape[1], v.shape[2]
    out = q.new_empty(q.shape[0], heads, dv) if out is None else out
    cols = (q_starts.tolist(), q_lens.tolist(), kv_starts.tolist(), kv_lens.tolist())
    for qs, n, ks, m in zip(*cols, strict=True):
        if n == 0:
            continue
        assert n <= m, f"a row has {n} queries but only {m} keys"
        prefix = m - n
        kf = k[ks : ks + m].float().transpose(0, 1)  # [H, m, dqk]
        vf = v[ks : ks + m].float().transpose(0, 1)  # [H, m, dv]
        chunk = max(1, SCORES_BUDGET // (4 * heads * m))
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            end = prefix + j  # keys the chunk's last query sees
            qf = q[qs + i : qs + j].float().transpose(0, 1)  # [H, c, dqk]
            scores = torch.matmul(qf, kf[:, :end].transpose(1, 2)) * scale  # [H, c, end]
            q_pos = prefix + torch.arange(i, j, device=q.device)
            allowed = torch.arange(end, device=q.device)[None, :] <= q_pos[:, None]
            scores = scores.masked_fill(~allowed, float("-inf"))
            o = torch.matmul(torch.softmax(scores, dim=-1), vf[:, :end])  # [H, c, dv]
            out[qs + i : qs + j] = o.transpose(0, 1).to(out.dtype)
    return out
