"""Grouped MoE GEMM, contiguous layout, in plain PyTorch (float32 math): the truth.

Tokens are sorted by expert: rows offsets[e] .. offsets[e+1] of x go through expert e. y = x W_e^T."""

from __future__ import annotations


def moe_grouped_gemm(x, w, offsets, out=None):
    """`MoeGroupedGemm`, an expert at a time."""
    out = x.new_empty(x.shape[0], w.shape[1]) if out is None else out
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = (x[lo:hi].float() @ w[e].float().T).to(out.dtype)
    return out
