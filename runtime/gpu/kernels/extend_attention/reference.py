"""Extend (prefill with a cached prefix) attention in plain PyTorch, row by row: the truth."""

from __future__ import annotations

import torch

from runtime.gpu.kernels.decode_attention.reference import attend


def extend_attention(
    q, k_pool, v_pool, req_to_token, rows, prefix_lens, extend_lens, q_starts, scale, max_extend=None,
    out=None,
):  # fmt: skip
    """`ExtendAttention`, row by row."""
    out = torch.empty_like(q) if out is None else out
    cols = (rows.tolist(), prefix_lens.tolist(), extend_lens.tolist(), q_starts.tolist())
    for row, prefix, n, start in zip(*cols, strict=True):
        if n == 0:
            continue
        slots = req_to_token[row, : prefix + n]
        o = attend(q[start : start + n], k_pool[slots], v_pool[slots], scale, prefix)
        out[start : start + n] = o.to(q.dtype)
    return out


def prefill_attention(q, k, v, q_starts, lens, scale, max_len=None, out=None, cached=None):
    """`PrefillAttention`, row by row."""
    out = torch.empty_like(q) if out is None else out
    n_rows = len(lens)
    prefixes = cached[4].tolist() if cached is not None else [0] * n_rows
    rows = cached[3].tolist() if cached is not None else [0] * n_rows
    for start, n, row, prefix in zip(q_starts.tolist(), lens.tolist(), rows, prefixes, strict=True):
        if n == 0:
            continue
        keys, values = k[start : start + n], v[start : start + n]
        if prefix:
            slots = cached[2][row, :prefix]
            keys = torch.cat([cached[0][slots].to(k.dtype), keys])
            values = torch.cat([cached[1][slots].to(v.dtype), values])
        out[start : start + n] = attend(q[start : start + n], keys, values, scale, prefix).to(q.dtype)
    return out
