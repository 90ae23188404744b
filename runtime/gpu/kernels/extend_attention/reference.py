"""Extend (prefill with a cached prefix) attention in plain PyTorch, row by row: the truth."""

from __future__ import annotations

import torch

from runtime.gpu.kernels.decode_attention.reference import attend


def extend_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    q_starts: torch.Tensor,
    scale: float,
    max_extend: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D], rows' new tokens concatenated; row b's tokens are q[q_starts[b] : +extend_lens[b]]
    at positions prefix_lens[b] + i. Their K/V are already stored: the row's keys are the slots
    req_to_token[rows[b], : prefix + extend], and new token i sees keys 0 .. prefix + i.
    Rows of one token (decode) are fine. Returns [T, Hq, D] in q's dtype."""
    out = torch.empty_like(q) if out is None else out
    cols = (rows.tolist(), prefix_lens.tolist(), extend_lens.tolist(), q_starts.tolist())
    for row, prefix, n, start in zip(*cols, strict=True):
        if n == 0:
            continue
        slots = req_to_token[row, : prefix + n]
        o = attend(q[start : start + n], k_pool[slots], v_pool[slots], scale, prefix)
        out[start : start + n] = o.to(q.dtype)
    return out


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_starts: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    max_len: int | None = None,
    out: torch.Tensor | None = None,
    cached: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """`extend_attention` with the new keys taken from the step's own k, v [T, Hkv, D] (rotated, as
    stored) instead of the pools: row b's new tokens are q[q_starts[b] : +lens[b]] and the same tokens of
    k and v, causal among themselves. `cached` = (k_pool, v_pool, req_to_token, rows, prefix_lens): each
    row's cached prefix, whose keys are the slots req_to_token[rows[b], :prefix_lens[b]], seen by all its
    new tokens; None: no row has one. Only the rows' tokens of `out` are written. Returns [T, Hq, D] in
    q's dtype."""
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
