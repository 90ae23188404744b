"""RMSNorm (+ residual add) in Triton: one program per token row, the whole row in registers.

Rounds like the reference: the sum h = x + residual is rounded to the input dtype (it is the next
residual), the normalised row is rounded before the weight multiply."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import next_pow2


@triton.jit
def _rms_norm(
    X, Res, W, Out, ResOut, n_cols, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + t * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(Res + t * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + t * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    y = (xf * inv).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + t * stride_o + offs, (y * w).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def inv_rms_of_row(X, t, stride_x, n_cols, eps, BLOCK: tl.constexpr):
    """1 / rms of row t of X (float32), in BLOCK-wide chunks: for kernels that scale a folded
    projection's output by it (`reference.scale_by_inv_rms`)."""
    acc = tl.zeros([BLOCK], tl.float32)
    for c in range(0, n_cols, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        x = tl.load(X + t * stride_x + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
        acc += x * x
    return tl.rsqrt(tl.sum(acc, 0) / n_cols + eps)


def rms_norm(x, weight, eps, residual=None):
    """`RmsNorm`; x and residual with unit column stride."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous()
    n_rows, n_cols = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(x) if residual is not None else out
    res = residual if residual is not None else x
    assert res.stride(1) == 1 and res.shape == x.shape
    block = next_pow2(n_cols)
    if n_rows:
        _rms_norm[(n_rows,)](
            x, res, weight, out, res_out, n_cols, eps,
            x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)),
        )  # fmt: skip
    return out if residual is None else (out, res_out)
